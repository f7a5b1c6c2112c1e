import os
import signal
import sys
from pathlib import Path

# Actors defined under tests/ are unpickled by name in the processes Monarch starts, which
# inherit this environment: make the test helpers importable there too.
_here = str(Path(__file__).parent)
sys.path.insert(0, _here)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_here, os.environ.get("PYTHONPATH")]))

# A script that starts a command in the background (`cmd &`, no job control) starts it with
# SIGINT ignored, and every process it starts inherits that, `forge run` included. The tests that
# stop a run with SIGINT check what a terminal's Ctrl-C does: they need it delivered.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# GPU-only tests skip where there is no GPU; under FORGE_NO_SKIPS=1 every other skip fails CI.
pytest_plugins = ["helper_skips", "helper_order"]
