"""How a run ends when a scheduler or a person stops it.

SIGTERM (`kill`, `docker stop`, `systemctl stop`, a scheduler), SIGHUP (a closed terminal) and
SIGUSR1 (SLURM's warning before a `forge submit` job's time limit, after which the job requeues
itself: forge.cli) take the path Ctrl-C takes: the run's task is cancelled, so its `finally`
blocks run (generation in flight is abandoned, a training step in flight finished; the final
checkpoint, plots and export are written; every process is stopped), within
`shutdown.grace_s`. A second signal, or the grace running out, ends the run at once
(`stop_now`): every process it started is killed and its shared memory removed. Either way the
exit status is 128 + the signal's number.
"""

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import psutil

from forge.actors.trainer.checkpoint_folder import latest_step
from forge.observability.console import say
from forge.weights.shm_folders import remove_dead, remove_own

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


@dataclass
class ShutdownConfig:
    """What a run does when it is stopped with SIGTERM, SIGHUP or SIGUSR1.

    Args:
        grace_s: how long it may take to end as after Ctrl-C (a final checkpoint, plots and
            export, every process stopped) before it is ended at once without them. Under
            SLURM's default KillWait (30 s), after which SLURM sends SIGKILL.
    """

    grace_s: float = 20.0


class Stopped(Exception):
    """The run was stopped by `signum` and has ended cleanly."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_stoppable(
    main: Coroutine[Any, Any, Any], grace_s: float, checkpoints: str | None = None
) -> None:
    """Runs `main` in a new event loop; a signal of STOP_SIGNALS cancels it as Ctrl-C does and,
    once it has ended, raises Stopped. A second signal, or `grace_s` passing first, ends this
    process at once (`stop_now`, which names the newest checkpoint in `checkpoints`)."""
    received: list[int] = []
    # A thread, not the loop's timer: it fires even while a blocking call holds the loop. At
    # most one: a second signal ends the process.
    grace: list[threading.Timer] = []

    async def guarded() -> None:
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None  # a coroutine run by asyncio.run has its task

        def on_signal(signum: int) -> None:
            name = signal.Signals(signum).name
            if received:
                stop_now(signum, f"{name} again", checkpoints)
            received.append(signum)
            task.cancel()
            why = f"{name}, and {grace_s:g} s later the run had not ended"
            timer = threading.Timer(grace_s, stop_now, (signum, why, checkpoints))
            timer.daemon = True
            timer.start()
            grace.append(timer)
            _tell(
                f"forge: {name}: ending the run as after Ctrl-C, within {grace_s:g} s "
                "(a second signal ends it at once)"
            )

        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            await main
        except asyncio.CancelledError:
            if not received:
                raise  # Ctrl-C: asyncio.run raises KeyboardInterrupt
        if received:
            raise Stopped(received[0])

    try:
        asyncio.run(guarded())
    finally:
        for timer in grace:
            timer.cancel()


def stop_now(signum: int, why: str, checkpoints: str | None = None) -> None:
    """Ends this process at once with status 128 + `signum`: kills every process it started
    and removes the shared memory they and it held, without waiting for anything else. The
    line it says names the step the run resumes from (the newest in `checkpoints`)."""
    step = latest_step(checkpoints)
    resumes = f"it resumes from step {step}" if step else "no checkpoint to resume from"
    _tell(f"forge: {why}: ended at once; {resumes}")
    children = psutil.Process().children(recursive=True)
    # A multiprocessing resource tracker removes the semaphores (/dev/shm/sem.*) of its
    # process once that process is gone, and then exits: killed, it would leave them.
    trackers = [c for c in children if _is_resource_tracker(c)]
    for child in children:
        if child not in trackers:
            _kill(child)
    psutil.wait_procs(children, timeout=10)
    for tracker in trackers:
        _kill(tracker)  # one whose process outlived the wait
    remove_own()
    remove_dead()  # those of the processes just killed
    sys.stdout.flush()
    os._exit(128 + signum)


def _tell(line: str) -> None:
    """Says `line` on the console, if there still is one (after SIGHUP, the terminal is gone)."""
    try:
        say(line)
    except OSError:
        pass


def _is_resource_tracker(process: psutil.Process) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def _kill(process: psutil.Process) -> None:
    try:
        process.kill()
    except psutil.NoSuchProcess:
        pass
