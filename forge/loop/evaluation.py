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
from forge.loop.rollouts import Rollouts, record_outcomes
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
    (`eval/failed`), and training goes on. Results go to the
    step's metrics (`eval/reward`, `eval/reward/<function>`, the episodes' `eval/env/` counts)
    and to `eval.jsonl` in the run folder, one line per evaluation, tagged with the policy
    version evaluated.

    Args:
        rows: the held-out dataset rows (forge.data.datasets layout).
        rollouts: plays and scores the episodes (its generators take the colocated turn).
        cfg: the eval section (its `interval` and per-turn `max_tokens`).
        last_step: the run's last step, whose weights are always evaluated.
        path: the eval.jsonl file (appended).
    """

    def __init__(
        self, rows: list[dict], rollouts: Rollouts, cfg: EvalConfig, last_step: int, path: Path
    ) -> None:
        self.rows = rows
        self.rollouts = rollouts
        self.sampling = {"temperature": 0.0, "max_tokens": cfg.max_tokens}
        self.interval = cfg.interval
        self.last_step = last_step
        self.path = path
        self.task: asyncio.Task | None = None
        self.results: list[dict[str, Any]] = []

    def due(self, step: int) -> bool:
        """Whether the weights of `step` are evaluated: every `interval` steps, and the last."""
        return step % self.interval == 0 or step == self.last_step

    def updated(self, step: int, version: int) -> None:
        """The generators hold `version`, trained at `step`: evaluates it if due."""
        if self.due(step):
            self.start(step, version)

    def start(self, step: int, version: int) -> bool:
        """Starts evaluating `version` unless an evaluation is still running; says whether."""
        if self.task is not None and not self.task.done():
            record_metric("eval/skipped", 1, Reduce.SUM)
            return False
        self.task = asyncio.ensure_future(self._evaluate_or_report(step, version))
        return True

    async def wait(self) -> None:
        """Waits for the running evaluation, if any."""
        if self.task is not None:
            await self.task

    async def _evaluate_or_report(self, step: int, version: int) -> None:
        try:
            await self.evaluate(step, version)
        except Exception as e:
            record_metric("eval/failed", 1, Reduce.SUM)
            say(f"eval of version {version} failed: {(str(e).splitlines() or [repr(e)])[0]}")

    async def evaluate(self, step: int, version: int) -> dict[str, Any]:
        """Plays every row greedily and scores the answers; records and returns the result."""
        start = time.perf_counter()
        played = await all_or_none(self._play(row) for row in self.rows)
        outcomes = [outcome for (outcome,) in played]
        await self.rollouts.score(self.rows, outcomes)
        record_outcomes(outcomes, "eval/env")
        versions = [v for o in outcomes for v in o.trajectory.completion().sampled_versions()]
        names = sorted({name for o in outcomes for name in o.rewards})
        result = {
            "step": step,
            "version": version,
            "token_versions": [min(versions, default=version), max(versions, default=version)],
            "reward": _mean([o.reward for o in outcomes]),
            "rewards": {
                name: _mean([o.rewards.get(name, 0.0) for o in outcomes]) for name in names
            },
            "seconds": time.perf_counter() - start,
        }
        self._record(result)
        return result

    async def _play(self, row: dict) -> list:
        return await self.rollouts.play(row, 1, self.sampling, purpose="eval")

    def _record(self, result: dict[str, Any]) -> None:
        self.results.append(result)
        record_metric("eval/reward", result["reward"])
        record_metric("eval/version", result["version"])
        for name, value in result["rewards"].items():
            record_metric(f"eval/reward/{name}", value)
        with self.path.open("a") as f:
            f.write(json.dumps(result) + "\n")


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)
