"""Trainer checkpoints with torch.distributed.checkpoint: model, optimizer, scheduler, step, RNG.

Each checkpoint is a folder `<folder>/step-<n>`; a `latest` file written after the save names the
newest complete one, so a crash during a save leaves the previous checkpoint in charge.
Sharded state is saved per rank and re-sharded on load, so a run may resume on another number
of processes (RNG state is per rank and then starts afresh).
"""

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class CheckpointConfig:
    """Where and how often to checkpoint.

    Args:
        folder: None disables checkpointing.
        interval: save every this many steps (0: only when asked).
        keep: how many checkpoints to keep (older ones are deleted).
        resume: load the newest checkpoint in `folder` at start-up.
    """

    folder: str | None = None
    interval: int = 0
    keep: int = 2
    resume: bool = True


class _TrainState(Stateful):
    def __init__(self, model: Any, optimizer: Any, scheduler: Any, step: int) -> None:
        self.model, self.optimizer, self.scheduler, self.step = model, optimizer, scheduler, step

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {
            "model": model,
            "optim": optim,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            # Keyed by rank: DCP stores one copy of plain tensors that share a key across ranks.
            "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        rng = state["rng"].get(f"rank{dist.get_rank()}")
        if rng is not None:
            torch.set_rng_state(rng)


class Checkpointer:
    """Saves and restores one trainer's state; every rank calls every method."""

    def __init__(self, cfg: CheckpointConfig, model: Any, optimizer: Any, scheduler: Any) -> None:
        self.cfg = cfg
        self.parts = (model, optimizer, scheduler)
        self.folder = Path(cfg.folder) if cfg.folder else None

    def due(self, step: int) -> bool:
        return self.folder is not None and self.cfg.interval > 0 and step % self.cfg.interval == 0

    def save(self, step: int) -> Path:
        """Writes `step-<step>`, then points `latest` at it and deletes the oldest."""
        if self.folder is None:
            raise ValueError("checkpoint.folder is not set: nowhere to save")
        target = self.folder / f"step-{step}"
        dcp.save({"train": _TrainState(*self.parts, step)}, checkpoint_id=target)
        if dist.get_rank() == 0:
            (self.folder / "latest.tmp").write_text(target.name)
            (self.folder / "latest.tmp").replace(self.folder / "latest")
            for old in self._steps()[: -self.cfg.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return target

    def resume(self) -> int:
        """Loads the newest checkpoint if there is one (and resume is on); returns its step."""
        latest = self.folder / "latest" if self.folder else None
        if not self.cfg.resume or latest is None or not latest.exists():
            return 0
        state = _TrainState(*self.parts, 0)
        dcp.load({"train": state}, checkpoint_id=self.folder / latest.read_text().strip())
        return state.step

    def _steps(self) -> list[Path]:
        return sorted(self.folder.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
