"""A run stopped by a signal whose clean end does not end: the grace period or a second signal
ends it at once, with nothing it started left (a child process, a shared-memory folder)."""

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from forge.weights.shm_folders import SHM_ROOT

# A "run" that owns a child process and a shared-memory folder, and whose end (its `finally`)
# never finishes, as a close stuck on a hung process would.
STUCK_RUN = textwrap.dedent(
    """
    import asyncio, os, subprocess, sys
    from forge.loop.stop_signals import run_stoppable
    from forge.weights.shm_folders import ShmFolder

    folder = ShmFolder.create(f"test-stop-{os.getpid()}")
    child = subprocess.Popen(["sleep", "600"])

    async def main():
        try:
            print("ready", child.pid, folder.path, flush=True)
            await asyncio.Event().wait()
        finally:
            await asyncio.Event().wait()

    run_stoppable(main(), grace_s=float(sys.argv[1]))
    """
)


def start(grace_s: float) -> tuple[subprocess.Popen, psutil.Process, str]:
    """The stuck run, once it is running: its process, its child, its folder."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_RUN, str(grace_s)], stdout=subprocess.PIPE, text=True
    )
    _, pid, folder = proc.stdout.readline().split()
    return proc, psutil.Process(int(pid)), folder


def test_a_run_whose_end_outlasts_the_grace_period_is_ended_at_once():
    proc, child, folder = start(grace_s=0.5)
    assert folder.startswith(str(SHM_ROOT))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    out = proc.stdout.read()
    assert "SIGTERM, and 0.5 s later the run had not ended: ended at once" in out, out
    assert "no checkpoint to resume from" in out
    assert not psutil.pid_exists(child.pid)  # killed, and reaped before the exit
    assert not Path(folder).exists()


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_a_second_signal_ends_the_run_at_once(signum):
    proc, child, folder = start(grace_s=600)
    proc.send_signal(signum)
    taken = proc.stdout.readline()
    assert "a second signal ends it at once" in taken, taken
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == 128 + signum
    assert f"{signal.Signals(signum).name} again: ended at once" in proc.stdout.read()
    assert not psutil.pid_exists(child.pid)
    assert not Path(folder).exists()
