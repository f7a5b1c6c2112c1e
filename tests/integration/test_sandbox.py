"""The code sandbox on real processes: what a model's code may not do is stopped, reported, and
leaves no process, cgroup or folder behind. The tests expect bubblewrap and a writable cgroup
hierarchy (.ci/run installs bubblewrap; CI fails where either is missing, a user's run skips
saying which); the last test takes both away, as on a machine without them, and checks what is
still enforced."""

import asyncio
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from helper_cgroup import memory_cgroup

from forge.envs import sandbox as sandbox_module
from forge.envs.sandbox import Sandbox, SandboxConfig
from forge.envs.tools import ToolBox, python_tool

pytestmark = pytest.mark.integration

LIMITS = SandboxConfig(timeout_s=3.0, memory_mb=256, max_processes=16, output_bytes=200)

FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
DETACHED_CHILD = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("started")
"""


def leftovers() -> list[str]:
    """Sandbox processes, cgroups and folders that outlived their call."""
    procs = [
        " ".join(p.info["cmdline"] or [])
        for p in psutil.process_iter(["cmdline", "cwd"])
        if "forge-sandbox-" in " ".join(p.info["cmdline"] or []) + (p.info["cwd"] or "")
    ]
    cgroups = [str(p) for p in sandbox_module.CGROUP_ROOT.glob("**/forge-sandbox-*")]
    folders = [str(p) for p in Path(tempfile.gettempdir()).glob("forge-sandbox-*")]
    return procs + cgroups + folders


@pytest.fixture
def sandbox() -> Sandbox:
    box = Sandbox(LIMITS)
    missing = [name for name, holds in box.guarantees().items() if not holds]
    if missing:
        pytest.skip(f"not enforced on this machine: {missing} (bubblewrap, a writable cgroup)")
    yield box
    assert not leftovers()


async def test_code_runs_and_its_output_is_cut_to_the_limit(sandbox):
    result = await sandbox.run("print(6 * 7)")
    assert (result.status, result.stdout, result.exit_code) == ("ok", "42\n", 0)
    spam = await sandbox.run("print('x' * 10_000_000)")
    assert spam.status == "ok" and spam.truncated and spam.stdout == "x" * 200


async def test_an_exception_is_an_error_whose_last_line_names_it(sandbox):
    result = await sandbox.run("print('before')\nraise ValueError('no such digit')")
    assert (result.status, result.stdout, result.exit_code) == ("error", "before\n", 1)
    assert result.stderr.splitlines()[-1] == "ValueError: no such digit"


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("while True:\n    pass", "timeout"),
        (FORK_BOMB, "timeout"),
        ("x = bytearray(10 * 2**30)", "memory"),  # 10 GB at once
        ("x = [bytearray(2**20) for _ in range(10_000)]", "memory"),  # 10 GB a MB at a time
    ],
    ids=["infinite loop", "fork bomb", "10 GB at once", "10 GB piecemeal"],
)
async def test_what_would_take_the_machine_is_stopped_and_reported(sandbox, code, status):
    result = await sandbox.run(code)
    assert result.status == status, result


async def test_no_network_no_writes_outside_its_folder_and_no_process_outlives_it(sandbox):
    net = await sandbox.run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)")
    assert net.status == "error" and "Network is unreachable" in net.stderr
    target = Path(tempfile.mkdtemp(dir=Path.cwd())) / "written"
    write = await sandbox.run(f"open({str(target)!r}, 'w').write('x')")
    assert write.status == "error" and "Read-only file system" in write.stderr
    assert not target.exists()
    target.parent.rmdir()
    local = await sandbox.run(
        "open('scratch.txt', 'w').write('x')\nprint(open('scratch.txt').read())"
    )
    assert local.stdout == "x\n"
    detached = await sandbox.run(DETACHED_CHILD)
    assert detached.status == "ok" and detached.stdout == "started\n"
    # The fixture checks that its sleeping child is gone with the call.


async def test_calls_run_side_by_side():
    box = Sandbox(SandboxConfig(timeout_s=10.0))
    results = await asyncio.gather(*(box.run(f"print({i} ** 2)") for i in range(4)))
    assert [r.stdout for r in results] == ["0\n", "1\n", "4\n", "9\n"]


async def test_without_bubblewrap_or_cgroups_it_says_what_still_holds(monkeypatch, tmp_path):
    """A machine without bubblewrap or a writable cgroup hierarchy: the wall-clock limit, the
    output cut and the per-process memory limit still hold; network and file isolation do not,
    and `guarantees()` says so."""
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(sandbox_module, "CGROUP_ROOT", tmp_path)
    box = Sandbox(LIMITS)
    said = box.guarantees()
    assert said["timeout"] and said["output"] and not said["no_network"]
    assert not said["read_only_files"] and not said["memory_total"]
    assert (await box.run("while True:\n    pass")).status == "timeout"
    assert (await box.run("x = bytearray(10 * 2**30)")).status == "memory"
    assert (await box.run(f"import sys\nprint(sys.executable == {sys.executable!r})")).stdout == (
        "True\n"
    )
    assert not leftovers()


async def test_the_python_tool_answers_with_what_the_code_printed_or_why_it_stopped(sandbox):
    box = ToolBox([python_tool(sandbox)], timeout_s=LIMITS.timeout_s + 5)

    def call(code: str) -> str:
        body = json.dumps({"name": "python", "arguments": {"code": code}})
        return f"<tool_call>{body}</tool_call>"

    text = call("print(1234 * 5678)") + call("1 / 0") + call("while True:\n    pass")
    product, error, loop = await box.call_all(text)
    assert (product.ok, product.output) == (True, "7006652\n")
    raised = "python raised RuntimeError: "
    assert (error.ok, error.output) == (False, raised + "ZeroDivisionError: division by zero")
    assert (loop.ok, loop.output) == (False, raised + "stopped: timeout limit")


async def test_an_interpreter_under_tmp_runs_and_writes_to_its_own_tmpdir(sandbox, tmp_path):
    """As in a clone under /tmp whose venv holds the interpreter; the code's temporary files go
    to its own folder."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    box = Sandbox(dataclasses.replace(LIMITS, python=str(venv / "bin" / "python")))
    code = "import sys, tempfile\nprint(sys.prefix)\nprint(tempfile.mkstemp()[1])"
    result = await box.run(code)
    assert result.status == "ok", result
    prefix, temporary = result.stdout.splitlines()
    assert prefix == str(venv)
    assert Path(temporary).parent.name.startswith("forge-sandbox-")


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup", "bubblewrap alone"])
async def test_a_call_its_caller_cancels_ends_with_everything_it_started(
    sandbox, cgroups, monkeypatch, tmp_path
):
    """A caller's deadline (a tool call's, shorter than the sandbox's) cancels the call: its
    processes end then, not at the sandbox's own limit (the fixture checks none is left), with
    a cgroup or with bubblewrap's namespaces alone."""
    if not cgroups:
        monkeypatch.setattr(sandbox_module, "CGROUP_ROOT", tmp_path)
        sandbox = Sandbox(LIMITS)
    code = DETACHED_CHILD + "while True:\n    pass"
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            await sandbox.run(code)
    assert not leftovers()


async def test_a_file_past_the_size_limit_is_refused(sandbox):
    box = Sandbox(dataclasses.replace(LIMITS, file_mb=1))
    result = await box.run("open('big', 'wb').write(b'x' * (2 << 20))")
    assert result.status == "error" and "File too large" in result.stderr, result


def test_the_limits_of_the_cgroup_that_runs_the_sandbox_bound_its_code(sandbox, tmp_path):
    """A process in a memory cgroup of 128 MB (a SLURM job step's: the process in a child of the
    limited group) runs a sandbox that allows 1 GB: the sandbox's group is made inside the
    limited one, so code taking 256 MB is stopped there; the same call from outside completes."""
    runner = tmp_path / "runner.py"
    runner.write_text(
        "import asyncio, json\n"
        "from forge.envs.sandbox import Sandbox, SandboxConfig\n"
        "box = Sandbox(SandboxConfig(memory_mb=1024, timeout_s=30))\n"
        "where = asyncio.run(box.run('print(open(\"/proc/self/cgroup\").read())')).stdout\n"
        'big = asyncio.run(box.run(\'x = bytearray(256 << 20); x[::4096] = b"1" * len(x[::4096]);'
        ' print("allocated")\'))\n'
        "print(json.dumps({'where': where, 'status': big.status, 'stdout': big.stdout}))\n"
    )

    def run(*prefix: str) -> dict:
        command = [*prefix, sys.executable, str(runner)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
        return json.loads(done.stdout.splitlines()[-1])

    outside = run()
    assert outside["status"] == "ok" and outside["stdout"] == "allocated\n"
    with memory_cgroup(128 << 20, leaf=True) as procs:
        inside = run("sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh")
    limited = procs.parent.parent.name  # the runner sits in a child of the limited group
    memory = next(x for x in inside["where"].splitlines() if "memory" in x or x.startswith("0::"))
    assert f"/{limited}/" in memory and "/forge-sandbox-" in memory, inside["where"]
    assert inside["status"] == "memory" and "allocated" not in inside["stdout"], inside
