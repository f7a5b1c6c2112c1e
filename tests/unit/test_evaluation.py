"""Held-out evals without processes: each eval is one line of eval.jsonl and one metrics row of
its own, under the step whose weights it scored, however late it ends."""

import asyncio
import json
from collections import Counter

import pytest

from forge.data.completion import Completion
from forge.data.trajectory import Trajectory
from forge.envs.runner import EpisodeOutcome
from forge.loop.config import EvalConfig
from forge.loop.evaluation import Evaluator
from forge.loop.run_logs import RunLogs
from forge.observability import MetricsConfig, drain_local, record_metric

ROWS = [{"index": i, "question": f"q{i}", "answer": "a"} for i in range(4)]


@pytest.fixture(autouse=True)
def empty_buffer():
    drain_local()
    yield
    drain_local()


class FakeRollouts:
    """Answers every row with the generators' `version`, rewarded version / 10; an eval's
    answers wait for `release` while it is cleared."""

    def __init__(self) -> None:
        self.version = 0
        self.release = asyncio.Event()
        self.release.set()

    async def play(self, row: dict, n: int, sampling: dict, purpose: str) -> list:
        await self.release.wait()
        t = Trajectory([1, 2])
        t.add_turn(Completion([1, 2], [3, 4], "a", [-0.1, -0.2], [self.version] * 2, "stop"))
        reward = self.version / 10
        return [EpisodeOutcome(t, "done", reward, {"f": reward}, Counter(turns=1))]

    async def score(self, rows: list, outcomes: list) -> int:
        return 0


@pytest.fixture
def run(tmp_path):
    logs = RunLogs(tmp_path, MetricsConfig(console=False), sources=[])
    rollouts = FakeRollouts()
    yield logs, rollouts, Evaluator(ROWS, rollouts, EvalConfig(interval=1), 2, logs)
    logs.close()


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_each_eval_is_a_row_of_its_own_under_the_step_it_scored(run, tmp_path):
    logs, rollouts, evaluator = run
    rollouts.release.clear()
    evaluator.start(0, 0)  # the starting weights, before step 1...
    record_metric("train/loss", 1.0)
    await logs.step(1)  # ...ends after step 1's row
    rollouts.release.set()
    await evaluator.wait()
    for step in (1, 2):  # evals of the two steps both end before step 2's row
        rollouts.version = step
        evaluator.updated(step, step)
        await evaluator.wait()
    record_metric("train/loss", 0.5)
    await logs.step(2)

    rows = lines(tmp_path / "metrics.jsonl")
    evals = [r for r in rows if "eval/version" in r]
    assert [(r["step"], r["eval/version"], r["eval/reward"]) for r in evals] == [
        (0, 0, 0.0),
        (1, 1, 0.1),
        (2, 2, 0.2),
    ]
    assert evals[1]["eval/reward/f"] == 0.1 and evals[1]["eval/env/turns"] == 1
    steps = [r for r in rows if "eval/version" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert not any(key.startswith("eval/") for r in steps for key in r)
    records = lines(tmp_path / "eval.jsonl")
    assert [(r["step"], r["version"], r["token_versions"]) for r in records] == [
        (0, 0, [0, 0]),
        (1, 1, [1, 1]),
        (2, 2, [2, 2]),
    ]


async def test_scores_the_app_attached_join_the_eval_of_the_same_step(run, tmp_path):
    logs, rollouts, evaluator = run
    rollouts.version = 1
    evaluator.attach(1, {"loss": 2.5})
    evaluator.updated(1, 1)
    await evaluator.wait()
    (record,) = lines(tmp_path / "eval.jsonl")
    assert (record["step"], record["loss"], record["reward"]) == (1, 2.5, 0.1)
    (row,) = lines(tmp_path / "metrics.jsonl")
    assert (row["step"], row["eval/loss"], row["eval/reward"]) == (1, 2.5, 0.1)


async def test_a_skipped_eval_is_counted_in_the_step_and_its_attached_scores_kept(run, tmp_path):
    logs, rollouts, evaluator = run
    rollouts.release.clear()
    evaluator.start(1, 1)
    evaluator.attach(2, {"loss": 2.0})
    assert not evaluator.start(2, 2)  # the eval of step 1 still runs
    rollouts.release.set()
    await evaluator.wait()
    assert (await logs.step(2))["eval/skipped"] == 1
    by_step = {r["step"]: r for r in lines(tmp_path / "eval.jsonl")}
    assert by_step[2] == {"step": 2, "version": 2, "loss": 2.0}
    assert "reward" in by_step[1]


async def test_an_eval_that_ends_after_the_logs_closed_is_dropped(run, tmp_path):
    logs, rollouts, evaluator = run
    rollouts.release.clear()
    evaluator.start(2, 2)
    logs.close()  # the run stopped meanwhile
    rollouts.release.set()
    await evaluator.wait()
    assert not (tmp_path / "eval.jsonl").exists()
