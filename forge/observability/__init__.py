"""Metrics: `record_metric` anywhere, one aggregated row per step, written to the backends.

    from forge.observability import MetricLogger, MetricsConfig, Reduce, plot_run, record_metric

    record_metric("rollout/reward", reward)                 # in any actor or the driver
    logger = MetricLogger.from_config(run_dir, MetricsConfig(progress_total=100), sources=[...])
    await logger.step(step)                                 # in the driver, once per step
    logger.close()
    plot_run(run_dir)                                       # run_dir/metrics.png

`metrics` has no Monarch in it; the controller's `ForgeActor.flush_metrics` endpoint serves
`drain_local()`. TensorBoard, W&B and matplotlib are imported only when used.
"""

from forge.observability.backends import (
    Backend,
    ConsoleBackend,
    JsonlBackend,
    MetricsConfig,
    TensorBoardBackend,
    WandbBackend,
    build_backends,
)
from forge.observability.logger import FAILED_SOURCES_KEY, MetricLogger
from forge.observability.metrics import (
    Accumulator,
    Reduce,
    drain_local,
    merge,
    record_metric,
    reduce_metrics,
)
from forge.observability.plot import plot_run, plot_series
from forge.observability.progress import ProgressBar
from forge.observability.timeline import plot_timeline, read_timeline

__all__ = [
    "FAILED_SOURCES_KEY",
    "Accumulator",
    "Backend",
    "ConsoleBackend",
    "JsonlBackend",
    "MetricLogger",
    "MetricsConfig",
    "ProgressBar",
    "Reduce",
    "TensorBoardBackend",
    "WandbBackend",
    "build_backends",
    "drain_local",
    "merge",
    "plot_run",
    "plot_series",
    "plot_timeline",
    "read_timeline",
    "record_metric",
    "reduce_metrics",
]
