"""Seconds spent in the named parts of a span of work (a training step), each part added up over
its repeats:

    laps = Laps()
    ...                 # collating
    laps.lap("collate") # the seconds since the last lap (or since construction) go to "collate"
"""

import time
from collections import defaultdict


class Laps:
    """Adds the time since the previous lap to the part each lap names."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] += now - self._last
        self._last = now

    def metrics(self) -> dict[str, float]:
        """Each part's seconds, as "<part>_s"."""
        return {f"{part}_s": seconds for part, seconds in self.seconds.items()}
