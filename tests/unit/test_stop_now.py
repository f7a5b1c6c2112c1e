"""A run stopped by a signal whose clean end does not end: the grace period or a second signal
ends it at once, with nothing it started left (a child process, a shared-memory folder, a
child's semaphore)."""

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
    # A child holding a semaphore in /dev/shm, which its resource tracker removes after it.
    holder = "import multiprocessing as mp, sys, time; s = mp.get_context('spawn').Semaphore(); "
    holder += "print(s._semlock.name, flush=True); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    semaphore = child.stdout.readline().strip().lstrip("/")

    async def main():
        try:
            print("ready", child.pid, folder.path, semaphore, flush=True)
            await asyncio.Event().wait()
        finally:
            await asyncio.Event().wait()

    run_stoppable(main(), grace_s=float(sys.argv[1]))
    """
)


def start(grace_s: float) -> tuple[subprocess.Popen, psutil.Process, list[Path]]:
    """The stuck run, once it is running: its process, its child, what it has in /dev/shm
    (its folder and its child's semaphore)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_RUN, str(grace_s)], stdout=subprocess.PIPE, text=True
    )
    _, pid, folder, semaphore = proc.stdout.readline().split()
    shm = [Path(folder), SHM_ROOT / f"sem.{semaphore}"]
    assert all(path.exists() for path in shm), shm
    return proc, psutil.Process(int(pid)), shm


def test_a_run_whose_end_outlasts_the_grace_period_is_ended_at_once():
    proc, child, shm = start(grace_s=0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    out = proc.stdout.read()
    assert "SIGTERM, and 0.5 s later the run had not ended: ended at once" in out, out
    assert "no checkpoint to resume from" in out
    assert not psutil.pid_exists(child.pid)  # killed, and reaped before the exit
    assert not [path for path in shm if path.exists()]


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_a_second_signal_ends_the_run_at_once(signum):
    proc, child, shm = start(grace_s=600)
    proc.send_signal(signum)
    taken = proc.stdout.readline()
    assert "a second signal ends it at once" in taken, taken
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == 128 + signum
    assert f"{signal.Signals(signum).name} again: ended at once" in proc.stdout.read()
    assert not psutil.pid_exists(child.pid)
    assert not [path for path in shm if path.exists()]
