"""When a generator was busy: the intervals during which it had requests of one purpose in
flight, on its own wall clock, for the run's timeline."""

import contextlib
import time
from collections import Counter, deque
from collections.abc import Iterator
from typing import Literal

# What a generate call is for: the loop's rollouts, or a held-out evaluation.
Purpose = Literal["rollout", "eval"]


class BusySpans:
    """Intervals of `Purpose`: one opens when the first call of that purpose starts and closes
    when the last one running ends.

    Args:
        limit: closed intervals kept until taken; older ones are dropped, so memory stays
            bounded if nobody takes them.
    """

    def __init__(self, limit: int = 4096) -> None:
        self._running: Counter[str] = Counter()
        self._opened: dict[str, float] = {}
        self._closed: deque[tuple[str, float, float]] = deque(maxlen=limit)

    @contextlib.contextmanager
    def busy(self, purpose: Purpose) -> Iterator[None]:
        """Counts one call of `purpose` as running while the block runs."""
        if not self._running[purpose]:
            self._opened[purpose] = time.time()
        self._running[purpose] += 1
        try:
            yield
        finally:
            self._running[purpose] -= 1
            if not self._running[purpose]:
                self._closed.append((purpose, self._opened.pop(purpose), time.time()))

    def take(self) -> list[tuple[str, float, float]]:
        """The intervals closed since the last take: (purpose, start, end), oldest first."""
        spans = list(self._closed)
        self._closed.clear()
        return spans
