"""RewardRunner: reward functions run in worker processes, each call under a deadline.

A reward function is user code: it may raise, or loop forever in pure Python. An asyncio
timeout cannot interrupt a loop that never yields, and a thread cannot be killed, so each call
runs in a child process: the caller waits up to `timeout_s`, and a worker that overruns is
killed and replaced in the background. A function that raises leaves its worker alive.
Either way the call scores 0 for that function, is named in the result's `failed` and counted,
and the first failure of each kind is logged (function name, the error's first line); the
caller never stalls.

    runner = RewardRunner({"math": math_verify_reward}, weights={}, timeout_s=5.0)
    await runner.start()
    results = await runner.evaluate(rows, texts)   # list[RewardResult]
    await runner.close()

Functions travel to the workers with cloudpickle, so functions defined in a notebook or a
script (or registered with `cloudpickle.register_pickle_by_value`) work as well as importable
ones. Workers are fresh interpreters, not forks: forking a process that runs Monarch's threads
is unsafe.
"""

import asyncio
import logging
import math
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from forge.data.rewards import RewardFn, load_libraries

logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """One reward call failed: the function raised, timed out, or its worker died."""


@dataclass
class RewardResult:
    """The score of one completion.

    Args:
        reward: the weighted sum of the functions' scores.
        rewards: each function's score, by name (0.0 for a failed call).
        failed: the functions whose call raised or timed out, scored 0 here.
    """

    reward: float
    rewards: dict[str, float]
    failed: list[str] = field(default_factory=list)


class RewardRunner:
    """Scores completions with named reward functions in `num_workers` worker processes.

    Args:
        functions: name -> reward function.
        weights: name -> weight in the total reward; a function not listed weighs 1.0.
        timeout_s: deadline of one function on one completion.
        num_workers: worker processes; calls beyond that wait for a free worker (the wait
            does not count against the deadline).
        startup_timeout_s: deadline for a worker to import its functions and report ready.
    """

    def __init__(
        self,
        functions: Mapping[str, RewardFn],
        weights: Mapping[str, float],
        timeout_s: float,
        num_workers: int = 1,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if not functions:
            raise ValueError("RewardRunner needs at least one reward function")
        self.functions = dict(functions)
        self.weights = {name: float(weights.get(name, 1.0)) for name in self.functions}
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.startup_timeout_s = startup_timeout_s
        self._payload = cloudpickle.dumps(self.functions)
        self._idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._respawns: set[asyncio.Task[None]] = set()
        self._broken: BaseException | None = None
        self._calls = 0
        self._errors: Counter[str] = Counter()
        self._timeouts: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()  # (function, kind of error) logged once
        self._restarts = 0

    async def start(self) -> None:
        """Starts the workers and waits until each has loaded the functions.

        Raises:
            RewardError: a worker could not load the functions (the child's error).
        """
        workers = [self._spawn() for _ in range(self.num_workers)]
        try:
            await asyncio.gather(*(w.ready(self.startup_timeout_s) for w in workers))
        except BaseException:
            await self.close()
            raise
        for worker in workers:
            self._idle.put_nowait(worker)

    async def evaluate(
        self, rows: Sequence[Mapping[str, Any]], texts: Sequence[str]
    ) -> list[RewardResult]:
        """Scores `texts[i]` against `rows[i]` with every function; returns RewardResults.

        Never raises for a function's failure: that function scores 0 on that completion
        and the failure is counted (see `stats`).
        """
        if len(rows) != len(texts):
            raise ValueError(f"got {len(rows)} rows and {len(texts)} texts: they must match")
        calls = [
            (name, row, text)
            for row, text in zip(rows, texts, strict=True)
            for name in self.functions
        ]
        outcomes = await asyncio.gather(*(self._score(*call) for call in calls))
        results = []
        per_row = len(self.functions)
        for start in range(0, len(outcomes), per_row):
            scores = dict(zip(self.functions, outcomes[start : start + per_row], strict=True))
            failed = [name for name, score in scores.items() if score is None]
            rewards = {name: score or 0.0 for name, score in scores.items()}
            total = sum(self.weights[name] * score for name, score in rewards.items())
            results.append(RewardResult(reward=total, rewards=rewards, failed=failed))
        return results

    def stats(self) -> dict[str, Any]:
        """Counts since start: calls, errors and timeouts per function, worker restarts."""
        return {
            "calls": self._calls,
            "errors": dict(self._errors),
            "timeouts": dict(self._timeouts),
            "failures": sum(self._errors.values()) + sum(self._timeouts.values()),
            "worker_restarts": self._restarts,
        }

    async def close(self) -> None:
        """Stops the workers (killing any that is busy); later calls raise RewardError."""
        for task in self._respawns:
            task.cancel()
        for worker in list(self._workers):
            worker.kill()
        self._workers.clear()
        while not self._idle.empty():
            self._idle.get_nowait()
        self._fail_waiters(RuntimeError("the runner is closed"))

    async def _score(self, name: str, row: Mapping[str, Any], text: str) -> float | None:
        """One function on one completion: its score, or None if it failed (counted, logged)."""
        worker = await self._idle.get()
        if worker is None:  # see _fail_waiters: pass the news on, then fail
            self._idle.put_nowait(None)
            raise RewardError(f"no reward worker: {self._broken}")
        self._calls += 1
        try:
            score = await worker.call(name, row, text, self.timeout_s)
        except TimeoutError:
            self._timeouts[name] += 1
            logger.warning(
                "reward %r timed out after %.1f s; restarting its worker", name, self.timeout_s
            )
            self._replace(worker)
            return None
        except RewardError as e:
            self._errors[name] += 1
            self._log_failure(name, str(e))
            if worker.alive():
                self._idle.put_nowait(worker)
            else:
                self._replace(worker)
            return None
        except BaseException:
            # Cancelled mid-call: the worker's late answer would reach the next call instead.
            self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        return score

    def _log_failure(self, name: str, error: str) -> None:
        """Logs the first failure of `name` with each kind of error; all are counted (stats).

        A checker that raises on one completion usually raises on many: once is enough to
        name it in the log, the counts show how often.
        """
        line = error.splitlines()[0] if error else "no message"
        kind = line.split(":", 1)[0]  # the exception's type: _serve sends "Type: message"
        if (name, kind) in self._logged:
            return
        self._logged.add((name, kind))
        logger.warning(
            "reward %r failed: %s (a failure, not a score; later %s failures are counted only)",
            name,
            line,
            kind,
        )

    def _spawn(self) -> "_Worker":
        worker = _Worker(self._payload)
        self._workers.add(worker)
        return worker

    def _replace(self, worker: "_Worker") -> None:
        """Kills `worker` and starts another in the background; it serves once ready."""
        worker.kill()
        self._workers.discard(worker)
        self._restarts += 1
        task = asyncio.get_running_loop().create_task(self._respawn())
        self._respawns.add(task)
        task.add_done_callback(self._respawns.discard)

    async def _respawn(self) -> None:
        worker = self._spawn()
        try:
            await worker.ready(self.startup_timeout_s)
        except Exception as e:
            # The functions loaded at start, so this is the machine (memory, processes): make
            # every waiting call fail rather than wait for a worker that will never come.
            logger.error("cannot restart a reward worker: %s", e)
            worker.kill()
            self._fail_waiters(e)
            return
        self._idle.put_nowait(worker)

    def _fail_waiters(self, reason: BaseException) -> None:
        """Makes every call waiting for a worker, and every later one, raise `reason`."""
        self._broken = reason
        self._idle.put_nowait(None)


class _Worker:
    """One child process running reward calls one at a time, over a socket pair."""

    def __init__(self, payload: bytes) -> None:
        self._conn, child_conn = multiprocessing.Pipe()
        # A fresh interpreter rather than multiprocessing's "spawn", which re-runs the parent's
        # main script in the child (a script without a __main__ guard would start over).
        serve = f"_serve({child_conn.fileno()}, {os.getpid()})"
        code = f"from forge.data.reward_runner import _serve; {serve}"
        # The parent's sys.path, so that functions pickled by reference import in the child.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._process = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=[child_conn.fileno()], env=env
        )
        child_conn.close()
        self._payload = payload

    async def ready(self, timeout: float) -> None:
        """Sends the functions, waits for the child to load them; raises RewardError if not."""
        # In a thread: a large payload fills the socket until the child, still importing, reads.
        try:
            await asyncio.to_thread(self._conn.send_bytes, self._payload)
            status, value = await self._receive(timeout)
        except TimeoutError:  # before OSError, its base class
            raise RewardError(f"reward worker not ready after {timeout:.0f} s") from None
        except OSError as e:  # the child exited before reading: its error is on stderr
            raise RewardError(f"reward worker exited at start: {e}") from e
        if status != "ready":
            raise RewardError(f"reward worker cannot load the functions: {value}")

    async def call(self, name: str, row: Mapping[str, Any], text: str, timeout: float) -> float:
        """`functions[name](row, text)` in the child.

        Raises:
            TimeoutError: no answer within `timeout` seconds (the child is still busy).
            RewardError: the function raised or returned a non-finite number, or the child died.
        """
        try:
            self._conn.send((name, row, text))
        except OSError as e:
            raise RewardError(f"reward worker is gone: {e}") from e
        status, value = await self._receive(timeout)
        if status != "ok":
            raise RewardError(value)
        return value

    async def _receive(self, timeout: float) -> tuple[str, Any]:
        # poll() blocks, so it waits in a thread: the event loop keeps serving other calls.
        if not await asyncio.to_thread(self._conn.poll, timeout):
            raise TimeoutError(f"no answer in {timeout} s")
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            code = self._process.wait(timeout=5)
            raise RewardError(f"reward worker died (exit code {code})") from e

    def alive(self) -> bool:
        return self._process.poll() is None

    def kill(self) -> None:
        self._process.kill()
        # SIGKILL cannot be ignored, so the wait that reaps the child returns at once.
        self._process.wait(timeout=5)
        self._conn.close()


def _serve(fd: int, parent_pid: int) -> None:
    """The worker's main loop: load the functions, then answer (name, row, text) requests."""
    # A worker busy in a hung function when its parent dies would spin on forever: watch.
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    conn = Connection(fd)
    try:
        functions = cloudpickle.loads(conn.recv_bytes())
        load_libraries(functions.values())
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            name, row, text = conn.recv()
        except EOFError:  # the parent closed the pipe or died
            return
        try:
            score = float(functions[name](row, text))
            if not math.isfinite(score):
                raise ValueError(f"returned {score}, not a finite number")
            conn.send(("ok", score))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)
