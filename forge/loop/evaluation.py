"""Held-out evaluation: one greedy episode per fixed row, in the background."""

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.concurrency import all_or_none
from forge.data.datasets import DataConfig, PromptDataset, Row, open_dataset
from forge.loop.config import EvalConfig
from forge.loop.rollouts import Rollouts, outcome_metrics
from forge.loop.run_logs import RunLogs
from forge.observability import Reduce, record_metric
from forge.observability.console import say


@dataclass
class EvalRows:
    """The rows eval answers.

    Args:
        rows: the rows (forge.data.datasets layout).
        source: the dataset they come from.
        columns: the columns they carry.
        description: where they come from, for the run's start line.
    """

    rows: list[Row]
    source: str
    columns: tuple[str, ...]
    description: str

    def write(self, path: Path) -> None:
        """The rows' index, question and answer, one JSON object a line (eval_rows.jsonl)."""
        with path.open("w") as f:
            for row in self.rows:
                f.write(json.dumps({k: row[k] for k in ("index", "question", "answer")}) + "\n")


def eval_rows(cfg: EvalConfig, data: DataConfig, train: PromptDataset) -> EvalRows:
    """The rows `cfg` evaluates: held out of `train` (opened from `data` with
    `cfg.hold_out()`), or `cfg.size` rows of another split or source.

    Raises:
        DatasetError: the other split or source cannot be read.
    """
    if cfg.split is None and cfg.data is None:
        rows = train.held_out_rows(cfg.size)
        held = len(train.held_out)
        of = f"{len(rows)} of the {held}" if held > len(rows) else f"{len(rows)}"
        description = f"{of} rows held out of {train.name} (never trained on)"
        return EvalRows(rows, train.name, train.columns, description)
    source = open_dataset(cfg.data or dataclasses.replace(data, split=cfg.split))
    rows = [source.nth(i) for i in range(min(cfg.size, len(source)))]
    return EvalRows(rows, source.name, source.columns, f"{len(rows)} rows of {source.name}")


class Evaluator:
    """Scores the weights the generators hold on a fixed held-out set, without blocking.

    `start(step, version)` launches one evaluation as a task and returns at once: training
    goes on while each row is played as one episode, its turns sampled greedily, and the reward
    functions score its answer (an episode its environment cut short scores 0). An evaluation
    due while the previous one still runs is skipped and counted (`eval/skipped`), so evals
    never queue up behind each other; a failed evaluation is reported in one line and counted
    (`eval/failed`), and training goes on. Those two counts are the step's metrics.

    An evaluation's results belong to the step whose weights it scored (0: the starting ones;
    N: those trained at step N), not to the step during which it ended: each is one line of
    eval.jsonl and one metrics row of its own (`eval/reward`, `eval/reward/<function>`,
    `eval/version`, the episodes' `eval/env/` counts), written when it ends (`RunLogs.eval`).
    Scores the app takes of the same weights itself (SFT's held-out loss: `attach`) join them.

    Args:
        rows: the held-out dataset rows (forge.data.datasets layout).
        rollouts: plays and scores the episodes (its generators take the colocated turn).
        cfg: the eval section (its `interval` and per-turn `max_tokens`).
        last_step: the run's last step, whose weights are always evaluated.
        logs: where each evaluation is written.
    """

    def __init__(
        self, rows: list[dict], rollouts: Rollouts, cfg: EvalConfig, last_step: int, logs: RunLogs
    ) -> None:
        self.rows = rows
        self.rollouts = rollouts
        self.sampling = {"temperature": 0.0, "max_tokens": cfg.max_tokens}
        self.interval = cfg.interval
        self.last_step = last_step
        self.logs = logs
        self.task: asyncio.Task | None = None
        self.attached: dict[int, dict[str, float]] = {}  # by step, for its evaluation

    def due(self, step: int) -> bool:
        """Whether the weights of `step` are evaluated: every `interval` steps, and the last."""
        return step % self.interval == 0 or step == self.last_step

    def updated(self, step: int, version: int) -> None:
        """The generators hold `version`, trained at `step`: evaluates it if due."""
        if self.due(step):
            self.start(step, version)

    def attach(self, step: int, scores: dict[str, float]) -> None:
        """Scores the app took itself of the weights of `step` (SFT's `loss`): they join that
        step's evaluation (`eval.jsonl`'s `loss`, `eval/loss`), which must start after."""
        self.attached[step] = scores

    def start(self, step: int, version: int) -> bool:
        """Starts evaluating `version`, trained at `step`, unless an evaluation is still
        running; says whether. Scores attached to a skipped one are written alone."""
        scores = self.attached.pop(step, {})
        if self.task is not None and not self.task.done():
            record_metric("eval/skipped", 1, Reduce.SUM)
            self._log_alone(step, version, scores)
            return False
        self.task = asyncio.ensure_future(self._evaluate_or_report(step, version, scores))
        return True

    async def wait(self) -> None:
        """Waits for the running evaluation, if any."""
        if self.task is not None:
            await self.task

    async def _evaluate_or_report(self, step: int, version: int, scores: dict[str, float]) -> None:
        try:
            await self.evaluate(step, version, scores)
        except Exception as e:
            record_metric("eval/failed", 1, Reduce.SUM)
            say(f"eval of version {version} failed: {(str(e).splitlines() or [repr(e)])[0]}")
            self._log_alone(step, version, scores)

    async def evaluate(
        self, step: int, version: int, scores: dict[str, float] | None = None
    ) -> dict[str, Any]:
        """Plays every row greedily and scores the answers; writes and returns the record,
        `scores` (attached ones) included."""
        start = time.perf_counter()
        played = await all_or_none(self._play(row) for row in self.rows)
        outcomes = [outcome for (outcome,) in played]
        await self.rollouts.score(self.rows, outcomes)
        versions = [v for o in outcomes for v in o.trajectory.completion().sampled_versions()]
        names = sorted({name for o in outcomes for name in o.rewards})
        record = {
            "step": step,
            "version": version,
            # The generators may take newer weights while an eval runs (async runs).
            "token_versions": [min(versions, default=version), max(versions, default=version)],
            "reward": _mean([o.reward for o in outcomes]),
            "rewards": {
                name: _mean([o.rewards.get(name, 0.0) for o in outcomes]) for name in names
            },
            **(scores or {}),
            "seconds": time.perf_counter() - start,
        }
        env = {key: value for key, (value, _) in outcome_metrics(outcomes).items()}
        self.logs.eval(record, _row(record, env))
        return record

    async def _play(self, row: dict) -> list:
        return await self.rollouts.play(row, 1, self.sampling, purpose="eval")

    def _log_alone(self, step: int, version: int, scores: dict[str, float]) -> None:
        """Writes the scores attached to an evaluation that did not take place, if any."""
        if scores:
            record = {"step": step, "version": version, **scores}
            self.logs.eval(record, _row(record, {}))


# An eval record's fields that are not one of its figures.
_NOT_FIGURES = ("step", "rewards", "token_versions", "seconds")


def _row(record: dict[str, Any], env: dict[str, float]) -> dict[str, float]:
    """An eval's metrics row from its eval.jsonl `record` and its episodes' `env` counts:
    `eval/version`, `eval/reward`, `eval/reward/<function>`, attached scores (`eval/loss`),
    `eval/env/<count>`."""
    row = {f"eval/{key}": value for key, value in record.items() if key not in _NOT_FIGURES}
    row |= {f"eval/reward/{name}": value for name, value in record.get("rewards", {}).items()}
    return row | {f"eval/env/{key}": value for key, value in env.items()}


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)
