"""The batch record (forge.loop.record.batches) and the checks `forge replay` makes before it
starts a process (forge.loop.record.replay): where a replay starts, which keys a what-if may
change."""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from forge.data.completion import Completion
from forge.data.episode import Episode
from forge.loop.config import RLConfig
from forge.loop.record.batches import BatchRecord, RecordConfig, RecordError, StepRecord
from forge.loop.record.replay import ReplayError, checkpoint_folder, load_run, read, replay_steps
from forge.loop.run_folder import RunFolder, config_dict


def episode(i: int) -> Episode:
    completion = Completion(
        prompt_ids=[1, 2, 3],
        token_ids=[4, 5, 6],
        text="abc",
        logprobs=[0.1 + 0.2, -1e-300, -2.5e-8],  # floats whose decimal form is long
        token_versions=[3, 3, 4],
        stop_reason="stop",
        metadata={"turns": 2, "replica": object()},  # kept as text: the trainer never reads it
        mask=[1, 0, 1],
    )
    return Episode(
        f"0-{i}", "0", completion, reward=1 / 3, rewards={"r": 1 / 3}, advantage=-0.70710678118,
        teacher_top_ids=[[1, 2], [3, 4], [5, 6]], teacher_top_logprobs=[[-0.1, -2.3]] * 3, row=i,
    )  # fmt: skip


def step(n: int, previous_kept: bool = True) -> StepRecord:
    return StepRecord(
        n, n - 1, [[episode(0)], [episode(1)]], "before", "after", 2, previous_kept, {"loss": 0.5}
    )


def test_a_step_reads_back_exactly_what_the_trainer_took(tmp_path):
    record = BatchRecord(tmp_path)
    record.write(step(7))
    got = record.read(7)
    want = step(7)
    for rank in want.batches:
        for e in rank:
            e.completion.metadata["replica"] = str(e.completion.metadata["replica"])
    assert dataclasses.replace(got, batches=[]) == dataclasses.replace(want, batches=[])
    # Every float bit for bit, the second rank's batch apart from the first's.
    assert got.batches[0][0].completion.logprobs == [0.1 + 0.2, -1e-300, -2.5e-8]
    assert [[e.episode_id for e in rank] for rank in got.batches] == [["0-0"], ["0-1"]]
    for got_e, want_e in zip(got.episodes(), want.episodes(), strict=True):
        metadata = got_e.completion.metadata
        assert metadata["replica"].startswith("<object object")
        assert dataclasses.replace(got_e.completion, metadata={}) == dataclasses.replace(
            want_e.completion, metadata={}
        )
        assert dataclasses.replace(got_e, completion=None) == dataclasses.replace(
            want_e, completion=None
        )


def test_last_n_keeps_the_newest_steps_and_rewind_drops_later_and_torn_ones(tmp_path):
    record = BatchRecord(tmp_path, RecordConfig(batches="last_n", last_n=2))
    for n in range(1, 6):
        record.write(step(n))
    assert record.steps() == [4, 5]
    everything = BatchRecord(tmp_path, RecordConfig(batches="all"))
    for n in range(6, 9):
        everything.write(step(n))
    (record.folder / ".step-000009.json.gz.tmp").write_bytes(b"torn")  # a crash mid-write
    RunFolder(tmp_path, None).rewind(6)  # a resumed run rewinds its folder, record included
    assert record.steps() == [4, 5, 6]
    assert sorted(p.name for p in record.folder.iterdir()) == [
        f"step-00000{n}.json.gz" for n in (4, 5, 6)
    ]


def checkpoints(root: Path, complete: list[int], partial: list[int]) -> Path:
    folder = root / "checkpoints"
    for n in complete + partial:
        (folder / f"step-{n}").mkdir(parents=True)
        if n in complete:
            (folder / f"step-{n}" / ".metadata").write_text("")
    (folder / "latest").write_text(f"step-{max(complete)}")
    return folder


def test_a_replay_starts_from_the_newest_checkpoint_it_can_reach_the_step_from(tmp_path):
    folder = checkpoints(tmp_path, complete=[2, 4], partial=[6])  # 6: the driver's part only
    record = BatchRecord(tmp_path)
    for n in range(1, 8):
        record.write(step(n, previous_kept=n != 5))
    steps = replay_steps(record, folder, 5)
    assert (steps.start, steps.end, steps.compare_from) == (4, 5, 5)
    # Step 7 kept the weights before step 6: a trainer loaded at 6 would lack them; 6 is
    # partial anyway, and 4 leads to 7 with both steps recorded.
    assert replay_steps(record, folder, 7).start == 4
    record.write(step(5))  # now step 5 had kept them too: one checkpoint earlier
    assert replay_steps(record, folder, 5).start == 2
    whole = replay_steps(record, folder, None)
    assert (whole.start, whole.end, whole.compare_from) == (0, 7, 1)

    BatchRecord(tmp_path, RecordConfig(last_n=3)).write(step(8))  # 6, 7, 8 left
    with pytest.raises(ReplayError, match=r"step 5 is not recorded .* \(recorded: 6..8\)"):
        replay_steps(record, folder, 5)
    with pytest.raises(ReplayError, match="step 8: no checkpoint before it from which every"):
        replay_steps(record, folder, 8)
    with pytest.raises(ReplayError, match="step 8: no checkpoint"):
        replay_steps(record, folder, None)


def test_a_what_if_changes_the_optimisation_only(tmp_path):
    cfg = RLConfig(run_dir=str(tmp_path))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config_dict(cfg)))  # an RL app's keys
    changed = load_run(tmp_path, ["trainer.loss.clip_eps_low=0.1", "trainer.optimizer.lr=1e-3"])
    assert (changed.trainer.loss.clip_eps_low, changed.trainer.optimizer.lr) == (0.1, 1e-3)
    assert json.dumps(config_dict(load_run(tmp_path).trainer)) == json.dumps(
        config_dict(cfg.trainer)
    )
    for key in ("trainer.model=tiny-qwen3", "data.path=x.jsonl", "generator.sampling.seed=1"):
        with pytest.raises(
            ReplayError, match=f"^{key.partition('=')[0]}: a replay trains the recorded"
        ):
            load_run(tmp_path, [key])
    with pytest.raises(ReplayError, match="no run here"):
        load_run(tmp_path / "nowhere")


def test_a_torn_record_and_a_moved_run_folder_are_handled(tmp_path):
    record = BatchRecord(tmp_path)
    record.write(step(1))
    record.path(2).write_bytes(b"not gzip")  # copied in by hand, say
    with pytest.raises(RecordError, match=r"step-000002.json.gz: cannot read the record of step 2"):
        record.read(2)
    with pytest.raises(ReplayError, match="cannot read the record of step 2"):
        read(record, 2)  # a replay's one-line error, exit status 2
    # Started as runs/x (its checkpoints in runs/x/checkpoints), replayed from elsewhere.
    cfg = RLConfig(run_dir="runs/x")
    assert checkpoint_folder(cfg, tmp_path / "x") == tmp_path / "x" / "checkpoints"
    cfg.trainer.checkpoint.folder = "/elsewhere/checkpoints"
    assert checkpoint_folder(cfg, tmp_path / "x") == Path("/elsewhere/checkpoints")
