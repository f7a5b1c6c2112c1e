"""RunFolder: which run a folder holds, when it may continue, what a resume keeps of its logs."""

import dataclasses

import pytest
import yaml

from forge.loop import RunConfig, RunFinished, RunFolderError
from forge.loop.run_folder import CONFIG, RunFolder


def config(tmp_path, **changes) -> RunConfig:
    cfg = RunConfig(run_dir=str(tmp_path / "run"), steps=6)  # checkpoints in run/checkpoints
    return dataclasses.replace(cfg, **changes)


def folder(cfg: RunConfig) -> RunFolder:
    return RunFolder(cfg.run_dir, cfg.trainer.checkpoint.folder)


def checkpoint(cfg: RunConfig, step: int) -> None:
    path = folder(cfg).checkpoints
    path.mkdir(parents=True, exist_ok=True)
    (path / "latest").write_text(f"step-{step}")


def logged(cfg: RunConfig, *steps: int, log: str = "metrics.jsonl") -> None:
    """The run wrote `steps`' records to `log`."""
    with (folder(cfg).path / log).open("a") as f:
        f.writelines(f'{{"step": {step}}}\n' for step in steps)


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
    logged(cfg, 1)
    other = config(tmp_path, seed=3)
    other.trainer.optimizer.lr = 0.5
    with pytest.raises(RunFolderError) as e:
        folder(other).open(other)
    message = str(e.value)
    assert "\n" not in message
    assert "seed (0 -> 3)" in message and "trainer.optimizer.lr" in message


def test_a_continued_run_may_change_its_guard_and_take_keys_a_later_forge_added(tmp_path):
    cfg = config(tmp_path)
    folder(cfg).open(cfg)
    logged(cfg, 1)
    saved = tmp_path / "run" / CONFIG
    older = yaml.safe_load(saved.read_text())
    del older["record"]  # written by a forge without the batch record
    saved.write_text(yaml.safe_dump(older))
    other = config(tmp_path)
    other.trainer.guard.action = "off"
    assert folder(other).open(other) == 0
    older["gone"] = 1  # a key since removed
    saved.write_text(yaml.safe_dump(older))
    with pytest.raises(RunFolderError, match="gone"):
        folder(other).open(other)


def test_a_run_without_checkpoints_cannot_be_continued(tmp_path):
    cfg = config(tmp_path)
    cfg.trainer.checkpoint.enabled = False
    cfg = dataclasses.replace(cfg)  # the config derives the folder again: none
    assert cfg.trainer.checkpoint.folder is None
    folder(cfg).open(cfg)
    logged(cfg, 1)
    with pytest.raises(RunFolderError, match="with trainer.checkpoint.enabled false: choose"):
        folder(cfg).open(cfg)


def test_a_start_that_failed_before_its_first_step_leaves_the_folder_to_any_config(tmp_path):
    failed = config(tmp_path)
    failed.trainer.optimizer.lr = 0.5
    folder(failed).open(failed)
    logged(failed, 0, log="eval.jsonl")  # the starting point's eval, then the failure
    cfg = config(tmp_path)
    assert folder(cfg).open(cfg) == 0
    assert (
        yaml.safe_load((tmp_path / "run" / CONFIG).read_text())["trainer"]["optimizer"]["lr"]
        == cfg.trainer.optimizer.lr
    )
    assert (tmp_path / "run" / "eval.jsonl").read_text() == ""  # the failed run's eval is gone
