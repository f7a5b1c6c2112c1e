import os
import sys
from pathlib import Path

# Actors defined under tests/ are unpickled by name in the processes Monarch starts, which
# inherit this environment: make the test helpers importable there too.
_here = str(Path(__file__).parent)
sys.path.insert(0, _here)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_here, os.environ.get("PYTHONPATH")]))

# GPU-only tests skip where there is no GPU; under FORGE_NO_SKIPS=1 every other skip fails CI.
pytest_plugins = ["helper_skips", "helper_order"]
