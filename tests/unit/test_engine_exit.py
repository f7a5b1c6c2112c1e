"""An engine core forked from forge's forkserver (`vllm_compat`) runs as a spawned one would:
with the environment its caller had when it started it, a process title vLLM can set, every
atexit handler run in order, and nothing it printed lost; and a SIGTERM (how vLLM stops it)
ends it with status 0."""

import subprocess
import sys

SCRIPT = """
import atexit, ctypes, os, signal, sys
import setproctitle
from forge.actors.vllm.vllm_compat import EngineCoreContext

def engine_core(ready):
    atexit.register(print, "registered first, runs last")
    atexit.register(print, "registered last, runs first")
    print("variable:", os.environ.get("FORGE_TEST_VARIABLE"))
    setproctitle.setproctitle("VLLM::EngineCore")  # as vLLM names it
    print("title:", open("/proc/self/cmdline").read().rstrip("\\0"))
    ctypes.CDLL(None).printf(b"buffered in C\\n")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ready.set()
    signal.pause()

if __name__ == "__main__":
    context = EngineCoreContext()
    ready = context.Event()
    os.environ["FORGE_TEST_VARIABLE"] = "set just before start"
    process = context.Process(target=engine_core, args=(ready,))
    process.start()
    del os.environ["FORGE_TEST_VARIABLE"]
    assert ready.wait(60)
    process.terminate()
    process.join()
    print("exit status", process.exitcode)
"""


def test_forked_engine_core_has_its_callers_environment_and_runs_every_handler(tmp_path):
    script = tmp_path / "engine_core.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert sorted(lines[:-1]) == sorted(
        [
            "variable: set just before start",
            "title: VLLM::EngineCore",
            "buffered in C",
            "registered last, runs first",
            "registered first, runs last",
        ]
    )
    assert lines.index("registered last, runs first") < lines.index("registered first, runs last")
    assert lines[-1] == "exit status 0"
