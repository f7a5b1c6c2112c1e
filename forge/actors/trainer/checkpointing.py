"""Trainer checkpoints with torch.distributed.checkpoint: model, optimizer, scheduler, the
divergence guard's history, step, RNG.

Each checkpoint is a folder `<folder>/step-<n>`; a `latest` file, written once the save is
complete, names the newest complete one, so a crash during a save leaves the previous
checkpoint in charge. The run driver puts its own state (replay buffer, dataset position) into
the same folder before the trainer saves, so `latest` always names a complete pair.
Sharded state is saved per rank and re-sharded on load, so a run may resume on another number
of processes (RNG state is per rank and then starts afresh).

With `async_save` the trainer pays only for staging a copy of its state in memory; the files are
written by a background thread (over a process group of its own, so its collectives never
interleave with training's) while training goes on, and `latest` moves when they are complete.
"""

import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from forge.actors.trainer.checkpoint_folder import (
    LATEST,
    CheckpointConfig,
    latest_step,
    step_folder,
    step_of,
)


class _TrainState(Stateful):
    def __init__(self, model: Any, optimizer: Any, scheduler: Any, guard: Any, step: int) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.guard, self.step = guard, step
        # A model with frozen parameters (LoRA) saves the trained ones alone: the frozen ones
        # are the base checkpoint's, loaded before any resume. DCP's load still fails on a
        # trained parameter the checkpoint lacks.
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        frozen = len(trained) < len(list(model.parameters()))
        self.trained = trained if frozen else None
        self.options = StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else None

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer, options=self.options)
        if self.trained is not None:
            # ignore_frozen_params keeps a tied frozen weight's second name (lm_head.weight,
            # torch 2.13): only the trained parameters' names stay.
            model = {name: value for name, value in model.items() if name in self.trained}
        return {
            "model": model,
            "optim": optim,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            # Keyed by rank: DCP stores one copy of plain tensors that share a key across ranks.
            "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()},
        } | ({} if self.guard is None else {"guard": self.guard.state_dict()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self.options,
        )
        self.scheduler.load_state_dict(state["scheduler"])
        if self.guard is not None:
            self.guard.load_state_dict(state["guard"])
        self.step = state["step"]
        rng = state["rng"].get(f"rank{dist.get_rank()}")
        if rng is not None:
            torch.set_rng_state(rng)


class Checkpointer:
    """Saves and restores one trainer's state; every rank calls every method."""

    def __init__(
        self, cfg: CheckpointConfig, model: Any, optimizer: Any, scheduler: Any, guard: Any
    ) -> None:
        self.cfg = cfg
        self.parts = (model, optimizer, scheduler, guard)
        self.folder = Path(cfg.folder) if cfg.folder else None
        self._pending: tuple[Future, Path] | None = None  # the last async save's write
        self._group: Any = None  # the background writes' own process group
        self._committed: Path | None = None  # the checkpoint `latest` names
        self._commit_lock = threading.Lock()

    def due(self, step: int) -> bool:
        return self.folder is not None and self.cfg.interval > 0 and step % self.cfg.interval == 0

    def save(self, step: int, background: bool | None = None) -> float:
        """Writes `step-<step>`, then points `latest` at it and deletes the oldest.

        In the background (default: `async_save`), returns once the state is staged and the
        write has started. Returns the seconds the caller was blocked.
        """
        if self.folder is None:
            raise ValueError(
                "no checkpoint folder (trainer.checkpoint.enabled: false): nowhere to save"
            )
        start = time.perf_counter()
        self.wait()  # one write at a time: `latest` moves in step order
        target = step_folder(self.folder, step)
        state = {"train": _TrainState(*self.parts, step)}
        if not (self.cfg.async_save if background is None else background):
            dcp.save(state, checkpoint_id=target)
            self._commit(target)
            return time.perf_counter() - start
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        pending = dcp.async_save(state, checkpoint_id=target, process_group=self._group)
        # Committed as soon as the write completes, so a trainer that dies later keeps it.
        pending.add_done_callback(lambda done: done.exception() or self._commit(target))
        self._pending = (pending, target)
        return time.perf_counter() - start

    def wait(self) -> None:
        """Blocks until the background write (if any) is complete and `latest` names it;
        raises the write's error."""
        if self._pending is not None:
            (pending, target), self._pending = self._pending, None
            pending.result()
            # `result()` can return before the done-callback has run: commit here too.
            self._commit(target)

    def _commit(self, target: Path) -> None:
        if dist.get_rank() != 0:
            return
        with self._commit_lock:  # the write's callback thread and `wait` may both get here
            if self._committed != target:
                self._point_latest_at(target)
                self._committed = target

    def _point_latest_at(self, target: Path) -> None:
        (self.folder / f"{LATEST}.tmp").write_text(target.name)
        (self.folder / f"{LATEST}.tmp").replace(self.folder / LATEST)
        # Only older ones: a newer folder may hold the driver's part of the next checkpoint.
        done = [p for p in self._steps() if step_of(p) <= step_of(target)]
        for old in done[: -self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def resume(self) -> int:
        """Loads the newest complete checkpoint if there is one; returns its step (else 0)."""
        step = latest_step(self.folder)
        return self.load(self.folder, step) if step else 0

    def load(self, folder: str | Path, step: int) -> int:
        """Loads checkpoint `step` of `folder`; returns its step."""
        path = step_folder(folder, step)
        model, optimizer, scheduler, guard = self.parts
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        if not any(k.startswith("train.guard") for k in keys):
            guard = None  # written before checkpoints held the guard's history: it starts empty
        state = _TrainState(model, optimizer, scheduler, guard, 0)
        dcp.load({"train": state}, checkpoint_id=path)
        return state.step

    def _steps(self) -> list[Path]:
        return sorted(self.folder.glob("step-*"), key=step_of)
