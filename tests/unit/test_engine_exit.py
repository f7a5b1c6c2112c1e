"""An engine process that skips the interpreter's teardown
(`vllm_compat.exit_without_teardown`) still runs every atexit handler, in order, and loses
nothing it printed."""

import subprocess
import sys

SCRIPT = """
import atexit, ctypes, sys
from forge.actors.vllm.vllm_compat import exit_without_teardown

atexit.register(print, "registered first, runs last")
exit_without_teardown()
atexit.register(print, "registered last, runs first")
sys.stdout.write("buffered in Python\\n")
ctypes.CDLL(None).printf(b"buffered in C\\n")
sys.exit(3)
"""


def test_exit_runs_every_handler_in_order_and_flushes_python_and_c_output():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert sorted(lines) == sorted(
        [
            "buffered in Python",
            "buffered in C",
            "registered last, runs first",
            "registered first, runs last",
        ]
    )
    assert lines.index("registered last, runs first") < lines.index("registered first, runs last")
    assert done.returncode == 0  # a stopped engine's status; AsyncLLM does not read it
