"""RunFolder: which run a folder holds, when it may continue, what a resume keeps of its logs."""

import dataclasses
import json

import pytest

from forge.loop import RunConfig, RunFinished, RunFolderError
from forge.loop.run_folder import CONFIG, RunFolder


def config(tmp_path, **changes) -> RunConfig:
    cfg = RunConfig(run_dir=str(tmp_path / "run"), steps=6)
    cfg.trainer.checkpoint.folder = str(tmp_path / "run" / "checkpoints")
    return dataclasses.replace(cfg, **changes)


def folder(cfg: RunConfig) -> RunFolder:
    return RunFolder(cfg.run_dir, cfg.trainer.checkpoint.folder)


def checkpoint(cfg: RunConfig, step: int) -> None:
    path = folder(cfg).checkpoints
    path.mkdir(parents=True, exist_ok=True)
    (path / "latest").write_text(f"step-{step}")


def test_a_new_folder_starts_at_zero_and_records_the_config(tmp_path):
    cfg = config(tmp_path)
    assert folder(cfg).open(cfg) == 0
    assert "steps: 6" in (tmp_path / "run" / CONFIG).read_text()
    assert folder(cfg).open(cfg) == 0  # the same run again, no checkpoint yet: from the start


def test_the_same_config_continues_from_the_newest_checkpoint(tmp_path):
    cfg = config(tmp_path)
    folder(cfg).open(cfg)
    checkpoint(cfg, 4)
    assert folder(cfg).open(cfg) == 4


def test_a_finished_run_is_not_run_again_but_more_steps_continue_it(tmp_path):
    cfg = config(tmp_path)
    folder(cfg).open(cfg)
    checkpoint(cfg, 6)
    with pytest.raises(RunFinished, match="6 of 6 steps taken"):
        folder(cfg).open(cfg)
    assert folder(cfg).open(dataclasses.replace(cfg, steps=10)) == 6


def test_another_config_is_refused_naming_the_keys_that_differ(tmp_path):
    cfg = config(tmp_path)
    folder(cfg).open(cfg)
    other = config(tmp_path, seed=3)
    other.trainer.optimizer.lr = 0.5
    with pytest.raises(RunFolderError) as e:
        folder(other).open(other)
    message = str(e.value)
    assert "\n" not in message
    assert "seed (0 -> 3)" in message and "trainer.optimizer.lr" in message


def test_resume_false_refuses_a_folder_that_holds_a_run(tmp_path):
    cfg = config(tmp_path)
    folder(cfg).open(cfg)
    with pytest.raises(RunFolderError, match="resume=false"):
        folder(cfg).open(cfg, resume=False)
    fresh = config(tmp_path / "other")
    assert folder(fresh).open(fresh, resume=False) == 0


def test_without_checkpoints_a_run_cannot_be_continued(tmp_path):
    cfg = config(tmp_path)
    cfg.trainer.checkpoint.folder = None
    folder(cfg).open(cfg)
    with pytest.raises(RunFolderError, match="trainer.checkpoint.folder"):
        folder(cfg).open(cfg)


def test_rewind_keeps_the_records_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    cfg = config(tmp_path)
    run = folder(cfg)
    run.open(cfg)
    log = run.path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "x": s}) for s in (1, 2, 3, 4)]
    log.write_text("\n".join(lines) + '\n{"step": 5, "x"')
    run.rewind(2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]


def test_driver_state_round_trips_beside_the_trainers_checkpoint(tmp_path):
    cfg = config(tmp_path)
    run = folder(cfg)
    state = {"groups": 12, "redo": [9, 11], "buffer": {"entries": [{"uses": 0}]}}
    run.save_driver_state(4, state)
    assert run.load_driver_state(4) == state
    assert run.load_driver_state(2) is None
