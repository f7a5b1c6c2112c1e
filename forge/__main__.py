"""`python -m forge`: the `forge` command line."""

from forge.cli import main

if __name__ == "__main__":
    main()
