"""`record_metric` and the per-process buffer behind it. Pure Python: no Monarch.

Any process (the driver, any actor) records into a buffer of its own, one `Accumulator` per key:

    record_metric("rollout/reward", 0.75)                    # Reduce.MEAN
    record_metric("rollout/tokens", 412, Reduce.SUM)

Recording costs a lock and a few float operations, never a message. Once per training step the
driver's `MetricLogger` asks every actor for `drain_local()` (the `flush_metrics` endpoint of
`ForgeActor`), `merge`s the accumulators with its own and reduces them to one float per key.
Accumulators keep sufficient statistics (sum and count, Welford mean and M2, min, max) rather
than per-process results, so a merged mean is the mean over every recorded value, not a mean of
per-process means, and a merged std is the std of every value.

Keys: the key names the reduced value itself ("rollout/reward" is the mean reward); to log two
reductions of one quantity, record it under two keys ("rollout/reward_max", Reduce.MAX). A "/"
groups keys by component, as TensorBoard shows them.
"""

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum

# Columns every metrics.jsonl line has besides the metrics themselves.
RESERVED_KEYS = frozenset({"step", "time"})


class Reduce(Enum):
    """How the values recorded under one key, in every process, become one number per step."""

    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    STD = "std"  # population std (ddof=0), like numpy.std
    COUNT = "count"  # how many values were recorded; the values themselves are ignored
    LAST = "last"  # the value recorded last, by wall clock across processes


@dataclass
class Accumulator:
    """Sufficient statistics of the values recorded under one key, mergeable across processes.

    Every statistic is kept whatever the reduction, so that `add` has no branches and `merge`
    is the same for all keys.
    """

    reduce: Reduce
    count: int = 0
    total: float = 0.0
    mean: float = 0.0  # Welford's running mean, for m2; MEAN itself uses total / count
    m2: float = 0.0  # sum of squared deviations from `mean`
    min: float = math.inf
    max: float = -math.inf
    last: float = math.nan
    last_time: float = -math.inf  # time.time(): comparable between processes of one job

    def add(self, value: float) -> None:
        """Adds one value."""
        self.count += 1
        self.total += value
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        self.last = value
        self.last_time = time.time()

    def merge(self, other: "Accumulator") -> None:
        """Adds every value `other` holds (Chan et al.'s parallel update for mean and M2)."""
        if other.reduce is not self.reduce:
            raise ValueError(
                f"a metric was recorded with Reduce.{self.reduce.name} in one place and "
                f"Reduce.{other.reduce.name} in another"
            )
        if other.count == 0:
            return
        count = self.count + other.count
        delta = other.mean - self.mean
        self.m2 += other.m2 + delta * delta * self.count * other.count / count
        self.mean += delta * other.count / count
        self.count = count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        if other.last_time > self.last_time:
            self.last, self.last_time = other.last, other.last_time

    def result(self) -> float:
        """The reduced value."""
        match self.reduce:
            case Reduce.MEAN:
                return self.total / self.count
            case Reduce.SUM:
                return self.total
            case Reduce.MAX:
                return self.max
            case Reduce.MIN:
                return self.min
            case Reduce.STD:
                return math.sqrt(self.m2 / self.count)
            case Reduce.COUNT:
                return float(self.count)
            case Reduce.LAST:
                return self.last


_buffer: dict[str, Accumulator] = {}
# Actors may record from helper threads (a data loader, an engine's callbacks) while their
# endpoint drains the buffer; the lock keeps every value in exactly one drain.
_lock = threading.Lock()


def record_metric(key: str, value: float, reduce: Reduce = Reduce.MEAN) -> None:
    """Records `value` under `key` in this process's buffer, to be reduced with `reduce`.

    Callable from any process. A key keeps one reduction everywhere; recording it with
    another raises ValueError. `value` may be a 0-dim tensor (a CUDA one synchronises).
    """
    value = float(value)
    with _lock:
        acc = _buffer.get(key)
        if acc is None:
            if key in RESERVED_KEYS:
                raise ValueError(f"metric key {key!r} is reserved for metrics.jsonl's columns")
            acc = _buffer[key] = Accumulator(reduce)
        elif acc.reduce is not reduce:
            raise ValueError(
                f"metric {key!r} was recorded with Reduce.{acc.reduce.name}, "
                f"now with Reduce.{reduce.name}"
            )
        acc.add(value)


def drain_local() -> dict[str, Accumulator]:
    """Returns this process's buffer and starts an empty one."""
    global _buffer
    with _lock:
        drained, _buffer = _buffer, {}
    return drained


def merge(*buffers: Mapping[str, Accumulator]) -> dict[str, Accumulator]:
    """Merges buffers (from `drain_local`, one per process) key by key; inputs are unchanged."""
    merged: dict[str, Accumulator] = {}
    for buffer in buffers:
        for key, acc in buffer.items():
            if key not in merged:
                merged[key] = replace(acc)
                continue
            try:
                merged[key].merge(acc)
            except ValueError as e:
                raise ValueError(f"metric {key!r}: {e}") from None
    return merged


def reduce_metrics(buffer: Mapping[str, Accumulator]) -> dict[str, float]:
    """One float per key, keys sorted."""
    return {key: buffer[key].result() for key in sorted(buffer)}
