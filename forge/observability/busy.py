"""BusyClock: the share of time some calls were running (a generator's, a teacher's)."""

import time


class BusyClock:
    """Measures the fraction of time with at least one call inside `async with`."""

    def __init__(self) -> None:
        self.inside = 0
        self.busy = 0.0
        self.since = self.start = time.perf_counter()

    async def __aenter__(self) -> None:
        if self.inside == 0:
            self.since = time.perf_counter()
        self.inside += 1

    async def __aexit__(self, *exc: object) -> None:
        self.inside -= 1
        if self.inside == 0:
            self.busy += time.perf_counter() - self.since

    def busy_seconds(self) -> float:
        """Seconds with at least one call inside so far."""
        return self.busy + (time.perf_counter() - self.since if self.inside else 0.0)

    def idle_fraction(self) -> float:
        elapsed = time.perf_counter() - self.start
        return 1 - self.busy_seconds() / max(elapsed, 1e-9)
