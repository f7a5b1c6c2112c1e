"""Routing policies: which healthy replica takes the next request."""

from collections.abc import Sequence
from typing import Protocol

from forge.controller.service.replica import Replica


class Router(Protocol):
    def pick(self, replicas: Sequence[Replica]) -> Replica: ...


class RoundRobin:
    """Cycles through the replicas; N calls over k replicas land N/k (±1) on each."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, replicas: Sequence[Replica]) -> Replica:
        replica = replicas[self._next % len(replicas)]
        self._next += 1
        return replica


class LeastLoaded:
    """Picks the replica with the fewest requests running or queued on it."""

    def pick(self, replicas: Sequence[Replica]) -> Replica:
        return min(replicas, key=lambda r: r.load)


ROUTERS = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}
