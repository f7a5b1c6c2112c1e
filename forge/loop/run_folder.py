"""The run folder: which run it holds, and what a resumed run keeps of its logs.

A run is identified by its folder. `config.yaml` there is the resolved config it was started
with; `steps` is the run's total. The same command continues the run from its newest
checkpoint; a larger `steps=` continues a finished one. A config that differs in anything else
is refused, so one folder never mixes two runs.

    folder = RunFolder(cfg.run_dir, checkpoints=cfg.trainer.checkpoint.folder)
    start = folder.open(cfg, resume=cfg.resume)   # the step to continue from; raises if it cannot
    folder.rewind(start)                          # logs hold steps 1..start only
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import yaml

from forge.actors.trainer.checkpoint_folder import latest_step, step_folder
from forge.config import ConfigError
from forge.loop.live_settings import ControlRecord
from forge.loop.record.batches import BatchRecord

CONFIG = "config.yaml"
CHECKPOINTS = "checkpoints"  # the folder of the run's checkpoints (trainer.checkpoint.enabled)
# The logs that hold one record per step (or per eval): {"step": n, ...} per line.
STEP_LOGS = ("metrics.jsonl", "eval.jsonl", "trained_episodes.jsonl", "timeline.jsonl")
# Keys a continued run may change: its length, how it was asked to start, and what the
# divergence guard does (a run it stopped continues with another action).
FREE_KEYS = ("steps", "resume", "trainer.guard")
DRIVER_STATE = "driver.pt"


class RunFolderError(ConfigError):
    """The run folder cannot host this run (another config's run, say); one line says why."""


class RunFinished(Exception):
    """The run folder's run has already taken `steps` steps: nothing to do."""


class RunFolder:
    """A run's folder and its checkpoints (which may live elsewhere)."""

    def __init__(self, path: str | Path, checkpoints: str | Path | None) -> None:
        self.path = Path(path)
        self.checkpoints = Path(checkpoints) if checkpoints else None

    @property
    def checkpoint_step(self) -> int:
        """The step of the newest complete checkpoint (0: none)."""
        return latest_step(self.checkpoints)

    def holds_run(self) -> bool:
        """Whether a run took a step here (or left checkpoints). A run that failed before its
        first step holds nothing to continue: its folder is anyone's."""
        return self.checkpoint_step > 0 or any(
            _step(line) >= 1 for line in _lines(self.path / STEP_LOGS[0])
        )

    def open(self, cfg: Any, resume: bool = True) -> int:
        """Checks that `cfg` may run here and records it; returns the step to continue from.

        Raises:
            RunFolderError: the folder holds another config's run, or any run when `resume`
                is false.
            RunFinished: the folder's run has taken `cfg.steps` steps already.
        """
        if not self.holds_run():
            self.rewind(-1)  # what a start that failed before its first step left
        else:
            if not resume:
                raise RunFolderError(
                    f"run folder {self.path} already holds a run and resume=false: choose "
                    "another run_dir or delete it (a folder never mixes two runs)"
                )
            if self.checkpoints is None:
                raise RunFolderError(
                    f"run folder {self.path} already holds a run, which cannot be continued "
                    "with trainer.checkpoint.enabled false: choose another run_dir or delete it"
                )
            self._check_same_run(cfg)
        step = self.checkpoint_step
        if step >= cfg.steps:
            raise RunFinished(
                f"run {self.path} is finished: {step} of {cfg.steps} steps taken "
                "(pass a larger steps= to continue it)"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        # Whole or not at all: `forge status` may read it at any moment.
        tmp = self.path / f"{CONFIG}.tmp"
        tmp.write_text(yaml.safe_dump(config_dict(cfg), sort_keys=False))
        tmp.replace(self.path / CONFIG)
        return step

    def _check_same_run(self, cfg: Any) -> None:
        saved_file = self.path / CONFIG
        if not saved_file.exists():
            return  # checkpoints alone (a folder shared by configs is the user's choice)
        saved, now = _flatten(yaml.safe_load(saved_file.read_text())), _flatten(config_dict(cfg))
        # A key the saved config lacks came with a later forge: the run had its default.
        differ = sorted(
            k for k in saved.keys() & now.keys() if not _free(k) and saved[k] != now[k]
        ) + sorted(k for k in saved.keys() - now.keys() if not _free(k))
        if differ:
            shown = ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in differ[:4])
            more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
            raise RunFolderError(
                f"run folder {self.path} holds a run of another config: {shown}{more}; "
                "use another run_dir, or resume=false in a new one"
            )

    def rewind(self, step: int) -> None:
        """Drops the log records and recorded batches of steps after `step`: a resumed run
        redoes those (under the settings changed live meanwhile: ControlRecord.rewind)."""
        BatchRecord(self.path).rewind(step)
        ControlRecord(self.path).rewind(step)
        for name in STEP_LOGS:
            log = self.path / name
            if log.exists():
                kept = [line for line in _lines(log) if _step(line) <= step]
                log.write_text("".join(line + "\n" for line in kept))

    def save_driver_state(self, step: int, state: dict[str, Any]) -> None:
        """Writes the driver's part of checkpoint `step` (before the trainer writes its own)."""
        folder = step_folder(self.checkpoints, step)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{DRIVER_STATE}.tmp"
        torch.save(state, tmp)
        tmp.replace(folder / DRIVER_STATE)

    def load_driver_state(self, step: int) -> dict[str, Any] | None:
        """The driver's part of checkpoint `step`, if it wrote one."""
        path = step_folder(self.checkpoints, step) / DRIVER_STATE if self.checkpoints else None
        if path is None or not path.exists():
            return None
        return torch.load(path, weights_only=True)


def config_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain yaml-able data (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _free(key: str) -> bool:
    """Whether a continued run may change `key` (a dotted key under FREE_KEYS)."""
    return any(key == free or key.startswith(f"{free}.") for free in FREE_KEYS)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a torn last line from a crash: dropped
