"""forge.observability without processes: exact merges, backends, progress bar, plot."""

import asyncio
import io
import json
import threading

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from forge.config import ConfigError, load_config
from forge.observability import (
    FAILED_SOURCES_KEY,
    Accumulator,
    ConsoleBackend,
    JsonlBackend,
    MetricLogger,
    MetricsConfig,
    ProgressBar,
    Reduce,
    TensorBoardBackend,
    drain_local,
    merge,
    plot_run,
    plot_series,
    record_metric,
    reduce_metrics,
)
from forge.observability.progress import short_names


@pytest.fixture(autouse=True)
def empty_buffer():
    drain_local()
    yield
    drain_local()


def buffer_of(key: str, values, reduce: Reduce = Reduce.MEAN) -> dict[str, Accumulator]:
    """What one process would send: its values recorded, then drained."""
    for v in values:
        record_metric(key, v, reduce)
    return drain_local()


# --- accumulators -------------------------------------------------------------------------------


def test_mean_over_all_values_not_mean_of_means():
    a = buffer_of("r", [1.0, 2.0, 3.0])
    b = buffer_of("r", [10.0, 20.0, 30.0, 40.0, 50.0])
    assert reduce_metrics(merge(a, b)) == {"r": 19.5}  # 156 / 8; the mean of means is 16


def test_std_merge_equals_numpy_std_of_all_values():
    rng = np.random.default_rng(0)
    parts = [rng.normal(5.0, 3.0, n) for n in (1, 7, 200)]
    buffers = [buffer_of("x", part, Reduce.STD) for part in parts]
    expected = np.std(np.concatenate(parts))
    assert reduce_metrics(merge(*buffers))["x"] == pytest.approx(expected, rel=1e-12)
    assert reduce_metrics(merge(*reversed(buffers)))["x"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "reduce, expected",
    [
        (Reduce.SUM, 1 + 5 + -2 + 7 + 4),
        (Reduce.MIN, -2),
        (Reduce.MAX, 7),
        (Reduce.COUNT, 5),
        (Reduce.LAST, 4),  # recorded last, in whichever buffer
        (Reduce.MEAN, 3),
    ],
)
def test_reductions_merge_across_buffers(reduce, expected):
    a = buffer_of("k", [1, 5], reduce)
    b = buffer_of("k", [-2, 7, 4], reduce)
    assert reduce_metrics(merge(b, a)) == {"k": expected}


def test_merge_leaves_its_inputs_alone_and_keeps_every_key():
    a = buffer_of("x", [1.0])
    b = buffer_of("x", [3.0])
    b.update(buffer_of("only_b", [4.0], Reduce.SUM))
    assert reduce_metrics(merge(a, b)) == {"only_b": 4.0, "x": 2.0}
    assert (a["x"].count, b["x"].count) == (1, 1)


def test_one_key_keeps_one_reduction():
    record_metric("x", 1.0, Reduce.SUM)
    with pytest.raises(ValueError, match="'x' was recorded with Reduce.SUM, now with Reduce.MAX"):
        record_metric("x", 1.0, Reduce.MAX)
    a = drain_local()
    b = buffer_of("x", [1.0], Reduce.MAX)
    with pytest.raises(ValueError, match="^metric 'x': .*Reduce.SUM.*Reduce.MAX"):
        merge(a, b)
    with pytest.raises(ValueError, match="reserved"):
        record_metric("step", 1.0)


def test_drain_returns_and_clears_the_buffer():
    record_metric("x", 2.0)
    assert reduce_metrics(drain_local()) == {"x": 2.0}
    assert drain_local() == {}


def test_every_value_recorded_from_threads_is_drained_exactly_once():
    def record() -> None:
        for _ in range(2000):
            record_metric("n", 1.0, Reduce.SUM)

    threads = [threading.Thread(target=record) for _ in range(4)]
    drained = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        drained.append(drain_local())
    for t in threads:
        t.join()
    drained.append(drain_local())
    assert reduce_metrics(merge(*drained)) == {"n": 8000.0}


# --- logger with stand-in sources ----------------------------------------------------------------


class _Values:
    def __init__(self, values: list) -> None:
        self._values = values

    def values(self) -> list:
        return self._values


class _MeshEndpoint:
    def __init__(self, replies: list) -> None:
        self.replies = replies

    async def call(self) -> _Values:
        return _Values(self.replies)


class _ServiceEndpoint:
    def __init__(self, replies: list) -> None:
        self.replies = replies

    async def fanout(self) -> list:
        return self.replies


class _DeadEndpoint:
    async def call(self) -> None:
        raise RuntimeError("the process this actor was running on failed")


class _Source:
    def __init__(self, endpoint) -> None:
        self.flush_metrics = endpoint


async def test_logger_merges_sources_with_the_driver_and_skips_a_dead_one(tmp_path):
    mesh = _Source(_MeshEndpoint([buffer_of("r", [1.0, 2.0]), buffer_of("r", [3.0])]))
    # A two-process replica answers with a list of buffers; a one-process one with a buffer.
    service = _Source(_ServiceEndpoint([[buffer_of("r", [4.0]), {}], buffer_of("r", [5.0])]))
    logger = MetricLogger(tmp_path, backends=[], sources=[mesh, _Source(_DeadEndpoint()), service])
    record_metric("r", 6.0)
    assert await logger.step(1) == {FAILED_SOURCES_KEY: 1.0, "r": 3.5}


async def test_a_source_past_its_deadline_is_skipped(tmp_path):
    class Slow:
        async def call(self) -> None:
            await asyncio.sleep(10)

    logger = MetricLogger(tmp_path, backends=[], sources=[_Source(Slow())], source_timeout_s=0.05)
    assert await logger.step(1) == {FAILED_SOURCES_KEY: 1.0}


# --- backends -----------------------------------------------------------------------------------


async def test_jsonl_has_one_parseable_line_per_step(tmp_path):
    logger = MetricLogger.from_config(tmp_path, MetricsConfig(console=False))
    for step in (1, 2):
        record_metric("rollout/reward", step / 2)
        record_metric("rollout/tokens", 10 * step, Reduce.SUM)
        await logger.step(step)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rollout/reward"], r["rollout/tokens"]) for r in rows] == [
        (1, 0.5, 10.0),
        (2, 1.0, 20.0),
    ]
    assert all(isinstance(r["time"], float) for r in rows)


def test_jsonl_appends_to_an_existing_run(tmp_path):
    for step in (1, 2):
        backend = JsonlBackend(tmp_path / "metrics.jsonl")
        backend.log(step, {"x": 1.0}, wall_time=0.0)
        backend.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


def test_console_prints_one_short_line_of_the_chosen_keys():
    out = io.StringIO()
    console = ConsoleBackend(["rollout/reward", "train/loss", "absent"], file=out)
    console.log(3, {"rollout/reward": 0.53125, "train/loss": 1.234e-7, "other": 1.0}, 0.0)
    assert out.getvalue() == "step 3 | reward 0.5312 | loss 1.234e-07\n"


def test_the_default_console_shows_generated_tokens_per_s_and_each_evals_reward():
    console = ConsoleBackend()
    step = {"rollout/reward": 0.5, "train/loss": 0.25, "generator/tokens_per_s": 90.0}
    line = "step 9 | rollout/reward 0.5 | loss 0.25 | generated tok/s 90"
    assert console.format(9, step) == line
    assert console.format_eval(10, {"eval/reward": 0.75}) == "eval of step 10 | reward 0.75"


def test_a_throughput_is_named_for_what_it_counts():
    keys = ["train/tokens_per_s", "generator/tokens_per_s", "teacher/tokens_per_s", "x/loss"]
    assert list(short_names(keys).values()) == [
        "trained tok/s",
        "generated tok/s",
        "teacher-scored tok/s",
        "loss",
    ]


def test_console_names_keys_that_share_a_last_part_in_full():
    console = ConsoleBackend(["train/loss", "eval/loss", "eval/reward"])
    line = console.format(2, {"train/loss": 1.5, "eval/loss": 0.5, "eval/reward": 1.0})
    assert line == "step 2 | train/loss 1.5 | eval/loss 0.5 | reward 1"


async def test_an_eval_is_a_row_of_its_own_under_the_step_it_scored(tmp_path):
    out, bar_out = io.StringIO(), io.StringIO()
    bar = ProgressBar(4, ["train/loss"], file=bar_out)
    console = ConsoleBackend(["train/loss", "eval/loss", "eval/reward"], file=out)
    jsonl = JsonlBackend(tmp_path / "metrics.jsonl")
    tensorboard = TensorBoardBackend(tmp_path / "tb")
    logger = MetricLogger(tmp_path, [jsonl, bar, console, tensorboard])
    record_metric("train/loss", 0.5)
    await logger.step(3)
    logger.log_eval(2, {"eval/version": 2.0, "eval/reward": 0.25, "eval/loss": 1.5})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "time"} for r in rows] == [
        {"step": 3, "train/loss": 0.5},
        {"step": 2, "eval/version": 2.0, "eval/reward": 0.25, "eval/loss": 1.5},
    ]
    assert out.getvalue().splitlines() == [
        "step 3 | train/loss 0.5",
        "eval of step 2 | loss 1.5 | reward 0.25",
    ]
    assert bar.n == 3  # the bar counts steps
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/reward")] == [(2, 0.25)]


def test_an_eval_without_any_of_the_console_keys_prints_nothing():
    assert ConsoleBackend(["train/loss"]).format_eval(2, {"eval/reward": 0.25}) is None


async def test_tensorboard_writes_event_files_when_enabled(tmp_path):
    logger = MetricLogger.from_config(tmp_path, MetricsConfig(console=False, tensorboard=True))
    assert any(isinstance(b, TensorBoardBackend) for b in logger.backends)
    record_metric("train/loss", 0.25)
    await logger.step(1)
    logger.close()
    # Read back with TensorBoard's own reader: the metrics extra declares it, so it is here.
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.25)]


def test_no_tensorboard_or_wandb_unless_enabled(tmp_path):
    logger = MetricLogger.from_config(tmp_path, MetricsConfig(console=False))
    assert [type(b) for b in logger.backends] == [JsonlBackend]
    logger.close()
    assert not (tmp_path / "tb").exists() and not (tmp_path / "wandb").exists()


async def test_wandb_offline_run_is_written_under_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricLogger.from_config(tmp_path, MetricsConfig(console=False, wandb=True))
    logger.log_eval(0, {"eval/reward": 0.25})
    record_metric("rollout/reward", 0.5)
    await logger.step(2)
    logger.log_eval(1, {"eval/reward": 0.5})  # after step 2's row: W&B steps only increase
    logger.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert any(run.glob("*.wandb"))


def test_metrics_config_is_a_yaml_config_section():
    cfg = load_config(MetricsConfig, None, ["console_keys=[a/x]", "wandb=true"])
    assert cfg.console_keys == ["a/x"] and cfg.wandb and cfg.wandb_mode == "offline"
    with pytest.raises(ConfigError, match="^command line: wandb_mode: .*'cloud'"):
        load_config(MetricsConfig, None, ["wandb_mode=cloud"])


# --- progress and plot --------------------------------------------------------------------------


def test_progress_bar_shows_steps_and_live_metrics():
    out = io.StringIO()
    bar = ProgressBar(4, keys=["rollout/reward", "train/loss", "third"], file=out)
    bar.log(1, {"rollout/reward": 0.25})
    bar.log(2, {"rollout/reward": 0.75, "train/loss": 0.5, "third": 9.0})
    bar.close()
    assert bar.n == 2
    last = out.getvalue().split("\r")[-1]
    assert "2/4" in last and "reward=0.75" in last and "loss=0.5" in last
    assert "third" not in last


def test_plot_has_the_logged_keys_and_skips_missing_ones(tmp_path):
    backend = JsonlBackend(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        backend.log(step, {"rollout/reward": step / 5, "train/mismatch_kl": 1e-3 / step}, 0.0)
    backend.close()
    path = plot_run(tmp_path)  # generator/tokens_per_s was never logged
    assert path == tmp_path / "metrics.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    with pytest.raises(ValueError, match="none of"):
        plot_run(tmp_path, keys=["absent"])


def test_plot_draws_each_eval_at_the_step_it_scored_from_the_starting_weights_on(tmp_path):
    """An eval's row is written when it ends, after later steps' rows."""
    backend = JsonlBackend(tmp_path / "metrics.jsonl")
    for step in range(1, 21):
        backend.log(step, {"train/loss": 1 / step}, 0)
        if step in (2, 12, 20):  # the evals of steps 0, 10 and 20 end
            scored = 10 * (step // 10)
            backend.log_eval(scored, {"eval/reward": 0.25 + scored / 40}, 0)
    backend.close()
    series = plot_series(tmp_path, ["eval/reward", "train/loss", "eval/loss"])
    assert series["eval/reward"] == ([0, 10, 20], [0.25, 0.5, 0.75])
    assert series["train/loss"][0] == list(range(1, 21))
    assert "eval/loss" not in series  # never evaluated: left out
    assert plot_run(tmp_path, ["eval/reward", "train/loss"]).stat().st_size > 1000
