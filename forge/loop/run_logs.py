"""The run's logs: each step's metrics, the episodes each step trained on, the timeline, and the
files and drawings a closed run points the user at."""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forge.data.episode import Episode
from forge.loop.generator_handle import GeneratorHandle
from forge.loop.live_settings import ControlRecord
from forge.observability import (
    MetricLogger,
    MetricsConfig,
    Reduce,
    drain_local,
    plot_run,
    plot_timeline,
    record_metric,
)
from forge.observability.console import say

# A generator's busy intervals on the timeline, by the purpose of its calls.
_BUSY = {"rollout": "generate", "eval": "eval"}


class RunLogs:
    """metrics.jsonl (and the configured backends), eval.jsonl, trained_episodes.jsonl and
    timeline.jsonl of one run folder, open from construction to `close`.

    Args:
        run_dir: the run folder.
        metrics: the metrics section (backends, the progress bar's total).
        sources: every role's actors, whose metrics each step pulls.
    """

    def __init__(self, run_dir: Path, metrics: MetricsConfig, sources: Sequence[Any]) -> None:
        self.run_dir = run_dir
        self.metrics = MetricLogger.from_config(run_dir, metrics, sources=sources)
        self._trained = (run_dir / "trained_episodes.jsonl").open("a")
        self._timeline = (run_dir / "timeline.jsonl").open("a")

    async def step(self, step: int) -> dict[str, float]:
        """Every process's metrics of `step`, written and returned."""
        return await self.metrics.step(step)

    async def discard(self) -> None:
        """Drops what was recorded so far: work that belongs to no step (a calibration)."""
        await self.metrics.discard()

    def replace_source(self, old: Any, new: Any) -> None:
        """Pulls metrics from `new` where it pulled them from `old` (a respawned trainer)."""
        self.metrics.sources = [new if s is old else s for s in self.metrics.sources]

    def eval(self, record: dict[str, Any], metrics: dict[str, float]) -> None:
        """Appends one eval's `record` to eval.jsonl and writes its `metrics` as a row of the
        step it evaluated (`record["step"]`). An eval that ends after the logs closed (the run
        stopped meanwhile) is dropped."""
        if self._trained.closed:
            return
        with (self.run_dir / "eval.jsonl").open("a") as f:  # a few lines a run
            f.write(json.dumps(record) + "\n")
        self.metrics.log_eval(record["step"], metrics)

    def batch(self, step: int, version: int, batch: list[list[Episode]]) -> None:
        """Appends which episodes (and of which versions) trained at `step` on weights
        `version`."""
        episodes = [e for rank in batch for e in rank]
        record = {
            "step": step,
            "trainer_version": version,
            "episodes": [e.episode_id for e in episodes],
            "rows": [e.row for e in episodes],
            "policy_versions": [e.policy_version for e in episodes],
            "turns": [e.completion.metadata.get("turns", 1) for e in episodes],
        }
        self._trained.write(json.dumps(record) + "\n")
        self._trained.flush()

    def span(self, step: int, lane: str, what: str, start: float, end: float) -> None:
        """Appends an interval to the run's timeline (forge.observability.timeline)."""
        span = {"step": step, "lane": lane, "what": what, "start": start, "end": end}
        self._timeline.write(json.dumps(span) + "\n")
        self._timeline.flush()

    async def generators(self, step: int, generator: GeneratorHandle) -> None:
        """The generators' deaths, throughput, and busy intervals (on the timeline)."""
        for m in generator.metrics():
            record_metric("generator/deaths", m["deaths"], Reduce.SUM)
            record_metric("generator/recoveries", m["recoveries"], Reduce.SUM)
            record_metric("generator/hangs", m["hangs"], Reduce.SUM)
        stats = await generator.stats()
        record_metric("generator/tokens_per_s", sum(s["tokens_per_s"] for s in stats))
        for i, spans in enumerate(await generator.busy_spans()):
            for purpose, begin, end in spans:
                self.span(step, f"generator {i}", _BUSY[purpose], begin, end)

    def close(self) -> None:
        """Closes the backends (the progress bar first, so lines said after it stay whole) and
        the files; what was recorded since the last step belongs to none and is dropped. A
        second call does nothing."""
        if self._trained.closed:
            return
        drain_local()
        self.metrics.close()
        self._trained.close()
        self._timeline.close()

    def show(self, plot_keys: Sequence[str]) -> None:
        """Draws the metrics and the timeline, and says where they are; a run that logged no
        step has nothing to show."""
        metrics = self.run_dir / "metrics.jsonl"
        if not (metrics.exists() and metrics.stat().st_size):
            return
        changes = ControlRecord(self.run_dir).changes()  # marked on both drawings
        plot = plot_run(self.run_dir, plot_keys, sorted({c["step"] for c in changes}))
        say(f"metrics: {metrics}\nplot: {plot}")
        if timeline := plot_timeline(self.run_dir, [c["time"] for c in changes]):
            say(f"timeline: {timeline}")
