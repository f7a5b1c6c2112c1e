"""MetricLogger: once per step, gathers every process's metrics and writes them out.

    logger = MetricLogger.from_config(run_dir, MetricsConfig(tensorboard=True),
                                      sources=[generator_service, trainer])
    for step in range(1, steps + 1):
        ...                                   # actors and the driver call record_metric
        metrics = await logger.step(step)     # {"rollout/reward": 0.41, ...}
    logger.close()
    plot_run(run_dir)

What a step holds is what was recorded since the previous `step` call, in whichever process.
An eval's metrics are not recorded but handed over whole (`log_eval`): a row of their own, under
the step whose weights they score.
"""

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forge.observability.backends import Backend, MetricsConfig, build_backends
from forge.observability.metrics import (
    Accumulator,
    Reduce,
    drain_local,
    merge,
    record_metric,
    reduce_metrics,
)

logger = logging.getLogger(__name__)

# Sources that could not be read in a step (dead, stopped, or past the deadline).
FAILED_SOURCES_KEY = "metrics/failed_sources"


class MetricLogger:
    """Per step: pulls every source's metrics, merges them with the driver's, writes them.

    `step` calls `flush_metrics` on every source, merges the buffers with the driver's own,
    reduces them to one float per key and hands the result to every backend.

    Args:
        run_dir: the run's folder (created if needed).
        backends: where metrics go; None builds the defaults of `MetricsConfig()`.
        sources: ForgeActor meshes (from `as_actor`) and services (from `as_service`). The
            list stays public: append sources spawned later.
        source_timeout_s: deadline for one source's reply. A source that fails or misses it is
            skipped for the step and counted under "metrics/failed_sources"; what it had
            buffered is lost, while every other source is logged as usual.
    """

    def __init__(
        self,
        run_dir: str | Path,
        backends: Sequence[Backend] | None = None,
        sources: Sequence[Any] = (),
        source_timeout_s: float = 60.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if backends is None:
            backends = build_backends(MetricsConfig(), self.run_dir)
        self.backends = list(backends)
        self.sources = list(sources)
        self.source_timeout_s = source_timeout_s

    @classmethod
    def from_config(
        cls, run_dir: str | Path, cfg: MetricsConfig, sources: Sequence[Any] = (), **kwargs: Any
    ) -> "MetricLogger":
        """A logger with the backends `cfg` selects."""
        return cls(run_dir, build_backends(cfg, run_dir), sources, **kwargs)

    async def step(self, step: int) -> dict[str, float]:
        """Collects, reduces and writes the metrics of `step`; returns them, keys sorted."""
        pulled = await asyncio.gather(*(self._pull(i, s) for i, s in enumerate(self.sources)))
        # The driver's buffer last: it then holds this step's failure counts too.
        metrics = reduce_metrics(merge(*(b for buffers in pulled for b in buffers), drain_local()))
        wall_time = time.time()
        for backend in self.backends:
            backend.log(step, metrics, wall_time)
        return metrics

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Writes one eval's metrics, of the weights trained at `step`, as a row of its own:
        an eval runs in the background, so it ends after later steps were written."""
        wall_time = time.time()
        for backend in self.backends:
            backend.log_eval(step, metrics, wall_time)

    async def discard(self) -> None:
        """Drops what every source and the driver recorded so far (work that belongs to no
        step, such as a calibration)."""
        await asyncio.gather(*(self._pull(i, s) for i, s in enumerate(self.sources)))
        drain_local()

    async def _pull(self, index: int, source: Any) -> list[dict[str, Accumulator]]:
        endpoint = source.flush_metrics
        try:
            async with asyncio.timeout(self.source_timeout_s):
                if hasattr(endpoint, "fanout"):  # a Service: every healthy replica
                    replies = await endpoint.fanout()
                else:  # a Monarch actor mesh: every process
                    replies = list((await endpoint.call()).values())
        except Exception as e:
            reason = (str(e).splitlines() or [repr(e)])[0]  # a timeout has no message
            logger.warning(
                "metrics source %d (%s) skipped: %s", index, type(source).__name__, reason
            )
            record_metric(FAILED_SOURCES_KEY, 1, Reduce.COUNT)
            return []
        # A service replica spanning several processes answers with one buffer per process.
        return [b for reply in replies for b in (reply if isinstance(reply, list) else [reply])]

    def close(self) -> None:
        """Closes every backend (flushes files, ends the W&B run, closes the progress bar)."""
        for backend in self.backends:
            backend.close()
