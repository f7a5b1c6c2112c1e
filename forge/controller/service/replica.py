"""One replica of a service: its actor, its state, its request slots and its metrics."""

import asyncio
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from monarch.actor import ActorError

from forge.controller.provisioner import HostLostError


class CallAbandoned(Exception):
    """Raised by `Replica.call` when the service gives up on the replica while the call waits:
    `died` says whether its process is known dead (else it hung)."""

    def __init__(self, message: str, died: bool) -> None:
        super().__init__(message)
        self.died = died


class ReplicaState(Enum):
    STARTING = "starting"
    HEALTHY = "healthy"
    FAILED = "failed"
    RECOVERING = "recovering"
    LOST = "lost"  # its host is gone: never respawned
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class ReplicaMetrics:
    """Counters of one replica over its whole life, respawns included."""

    requests: int = 0
    errors: int = 0  # the endpoint raised
    deaths: int = 0  # the process died
    hangs: int = 0  # missed `health_misses` health checks in a row
    check_errors: int = 0  # a health check raised instead of answering (not a miss)
    recoveries: int = 0
    latencies_s: deque = field(default_factory=lambda: deque(maxlen=4096))

    def latency_p50_s(self) -> float:
        return statistics.median(self.latencies_s) if self.latencies_s else 0.0


class Replica:
    """A replica's actor handle plus a cap of `max_concurrent` requests; the rest queue.

    `generation` counts respawns, so a failure seen by a call made before a respawn is not
    blamed on the new process. `abandon_calls` releases every call waiting on the current
    process, which a hung process would never answer.
    """

    def __init__(self, index: int, max_concurrent: int) -> None:
        self.index = index
        self.actor: Any = None
        self.mesh: Any = None
        self.world_size = 1
        self.state = ReplicaState.STARTING
        self.generation = 0
        self.recovery: asyncio.Task | None = None
        self.lost: HostLostError | None = None  # why it is LOST
        self.in_flight = 0
        self.queued = 0
        # Health checks the current process missed in a row: an answer or a respawn resets it.
        self.missed_checks = 0
        self.metrics = ReplicaMetrics()
        self._slots = asyncio.Semaphore(max_concurrent)
        self._calls: set[asyncio.Task] = set()
        self.abandoned_dead = False  # why the last abandoned calls were: a death, or a hang
        self.idle = asyncio.Event()
        self.idle.set()

    @property
    def load(self) -> int:
        return self.in_flight + self.queued

    @property
    def healthy(self) -> bool:
        return self.state is ReplicaState.HEALTHY

    async def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Calls endpoint `name`, waiting for a free slot first.

        One process answers with its value; a multi-process replica answers with the list of
        its ranks' values. An exception the endpoint raised is re-raised as itself. Raises
        CallAbandoned if `abandon_calls` runs while the call waits, queued or running.
        """
        calls = self._calls
        call = asyncio.ensure_future(self._call(name, args, kwargs))
        calls.add(call)
        try:
            return await call
        except asyncio.CancelledError:
            # `abandon_calls` swapped the set and cancelled the call; our own task was not.
            if calls is not self._calls and not asyncio.current_task().cancelling():
                message = f"replica {self.index} abandoned the call to {name}"
                raise CallAbandoned(message, self.abandoned_dead) from None
            raise
        finally:
            calls.discard(call)

    def abandon_calls(self, died: bool) -> None:
        """Makes every call waiting on this replica raise CallAbandoned (`died`: its process is
        known dead, else hung); later calls are not."""
        self.abandoned_dead = died
        abandoned, self._calls = self._calls, set()
        for call in abandoned:
            call.cancel()

    async def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        self.queued += 1
        self.idle.clear()
        try:
            try:
                await self._slots.acquire()
            finally:
                self.queued -= 1
            return await self._run(name, args, kwargs)
        finally:
            # Also when the call is abandoned in the queue, or a drain would wait forever.
            if self.load == 0:
                self.idle.set()

    async def _run(self, name: str, args: tuple, kwargs: dict) -> Any:
        self.in_flight += 1
        start = time.perf_counter()
        try:
            endpoint = getattr(self.actor, name)
            if self.world_size == 1:
                return await endpoint.call_one(*args, **kwargs)
            return list((await endpoint.call(*args, **kwargs)).values())
        except ActorError as e:
            self.metrics.errors += 1
            # The endpoint's own exception, so callers catch ValueError, not ActorError; the
            # remote traceback stays attached as the cause.
            raise e.exception from e
        finally:
            self.metrics.latencies_s.append(time.perf_counter() - start)
            self.metrics.requests += 1
            self.in_flight -= 1
            self._slots.release()

    def snapshot(self) -> dict[str, Any]:
        """This replica's state and metrics as plain values."""
        m = self.metrics
        return {
            "replica": self.index,
            "state": self.state.value,
            "requests": m.requests,
            "errors": m.errors,
            "deaths": m.deaths,
            "hangs": m.hangs,
            "check_errors": m.check_errors,
            "recoveries": m.recoveries,
            "missed_checks": self.missed_checks,
            "in_flight": self.in_flight,
            "queued": self.queued,
            "latency_p50_ms": 1000 * m.latency_p50_s(),
        }
