"""The console: forge's own lines on the terminal, every library's output in the run's log file.

vLLM, Monarch and torch write warnings to file descriptors 1 and 2, and so do the processes they
start, which inherit those descriptors. `capture_to(log)` points descriptors 1 and 2 of this
process at the log file before any actor starts, and keeps the terminal for `say` and for the
progress bar and step lines (`console()`).
"""

import os
import sys
from pathlib import Path
from typing import TextIO

_console: TextIO | None = None


def console() -> TextIO:
    """Where forge's own lines go: the terminal kept by `capture_to`, else stdout."""
    return _console or sys.stdout


def say(line: str) -> None:
    """Prints one of forge's own lines on the console."""
    print(line, file=console(), flush=True)


def capture_to(log: str | Path) -> None:
    """Sends everything written to stdout and stderr, by this process and by every process it
    starts from now on, to `log` (appended); forge's lines keep the terminal."""
    global _console
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if _console is None:
        _console = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, sys.stdout.fileno())
    os.dup2(fd, sys.stderr.fileno())
    os.close(fd)
