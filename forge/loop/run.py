"""Run: a started run's parts, what every app does with them, and its close.

An app subclasses Run, or RLLoop (forge.loop.rl) to train on its own generators' samples, and
writes only what makes it different: the roles it adds (its config's `roles()`, whose actors
its `__init__` takes from `parts.actors`) and, for RL, how an episode is scored.

    run = await MyApp.start(cfg)   # every part started (forge.loop.startup), or none left
    await run.steps(3)             # RL apps; `run()` runs to the end
    await run.close()              # final checkpoint, export, plot; every process stopped
"""

import asyncio
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Self

from forge.data.datasets import PromptDataset
from forge.data.episode import Episode
from forge.loop.config import RunConfig
from forge.loop.evaluation import EvalRows
from forge.loop.live_settings import ControlRecord
from forge.loop.run_folder import RunFinished
from forge.loop.startup import RunParts, open_data, start_parts
from forge.loop.trainer_handle import TrainerDied, TrainerHandle
from forge.observability import record_metric
from forge.observability.console import say
from forge.observability.startup import phase


class Run:
    """A started run. Subclasses add their own loop (`run`).

    Attributes:
        version: the policy version the generators hold (= optimizer steps taken).
        logged: the newest step whose metrics are logged.
        lifecycle, sync, logs, evaluator, placer, folder: the run's parts (forge.loop.startup).
        plot_keys: the metrics drawn in run_dir/metrics.png.
    """

    plot_keys: Sequence[str] = ("eval/reward", "train/loss", "generator/tokens_per_s")

    def __init__(self, cfg: RunConfig, parts: RunParts) -> None:
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        self.folder, self.placer, self.data = parts.folder, parts.placer, parts.data
        self.lifecycle, self.logs, self.sync = parts.trainer, parts.logs, parts.sync
        self.generator, self.rollouts, self.evaluator = (
            parts.generator, parts.rollouts, parts.evaluator,
        )  # fmt: skip
        self.started, self.resumed, self._exits = parts.started, parts.resumed, parts.exits
        self.version = self.logged = parts.resumed
        self.world = cfg.trainer_ranks  # data-parallel ranks: a batch is a list for each

    @property
    def trainer(self) -> TrainerHandle:
        """The running trainer (a respawn replaces it)."""
        return self.lifecycle.handle

    # --- start --------------------------------------------------------------------------------

    @classmethod
    async def start(cls, cfg: RunConfig) -> Self:
        """Starts every part and, when the run folder holds a checkpoint, continues from it
        (`run = await GRPO.start(cfg)` in a notebook). A failed start closes what it started.

        Raises:
            RunFinished: the folder's run took `steps` already (before anything starts).
        """
        exits = AsyncExitStack()
        try:
            run = cls(
                cfg, await start_parts(cfg, cls.open_data, cls.__name__, cls.plot_keys, exits)
            )
            await run.begin()
        except BaseException:
            await exits.aclose()
            raise
        return run

    async def begin(self) -> None:
        """What a constructed run does before its first step: the resumed driver state, the
        placement fitted, the starting point evaluated."""
        if self.resumed:
            await self.load_state_dict(self.folder.load_driver_state(self.resumed) or {})
            if self.sync is not None:
                await self.sync.sync(self.version)
        with phase("controller", "placement fit"):  # calibration, unless cached
            await self.fit_placement()
        say(self.placer.line())
        if self.evaluator is not None and not self.resumed:
            self.evaluator.start(0, self.version)  # the starting point, to compare against

    async def fit_placement(self) -> None:
        """Settles where generator and trainer run once both are up, before the first eval;
        loops that measure and move them override it (forge.loop.rl: `Placer.fit`)."""

    @classmethod
    def open_data(cls, cfg: RunConfig) -> tuple[PromptDataset, EvalRows | None]:
        """The app's training and eval rows (`forge.loop.startup.open_data`; an app that reads
        more of them checks it here)."""
        return open_data(cfg)

    async def state_dict(self) -> dict[str, Any]:
        """What the driver needs to continue from a checkpoint (the app's data position)."""
        return {}

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""

    # --- each step ----------------------------------------------------------------------------

    async def train(
        self, batches: list[list[Episode]], policy_version: int | None = None
    ) -> dict[str, float]:
        """One optimizer step, `batches[r]` on data-parallel rank r (`TrainerLifecycle.train`):
        the trainer's metrics.

        A run stopped meanwhile (Ctrl-C, SIGTERM) waits for the step and counts it before it
        stops: the trainer takes it whatever the caller does, and the final checkpoint must be
        of the step the weights are at, with the driver's state of that step.
        """
        call = self.lifecycle.train(self.version + 1, batches, policy_version)
        step = asyncio.ensure_future(call)
        try:
            metrics = await asyncio.shield(step)
        except asyncio.CancelledError:
            await step
            self.version += 1
            raise
        self.version += 1
        return metrics

    async def restart_trainer(self, error: TrainerDied) -> None:
        """Respawns a dead trainer from its newest checkpoint and moves the generators to its
        weights; the steps after that checkpoint are taken again."""
        self.version = self.logged = await self.lifecycle.restart(error, self.version)
        if self.sync is not None:
            await self.sync.sync(self.version)
        self.folder.rewind(self.version)  # the steps after the checkpoint are redone
        if ControlRecord(self.run_dir).changes():  # over the checkpoint's own settings
            await self.trainer.set_optimisation(self.cfg.trainer)

    @property
    def last_step(self) -> int:
        """The run's last step: `steps` is its total, resumes included."""
        return self.cfg.steps

    async def log_step(self, step: int, start: float) -> dict[str, float]:
        """Generator health and throughput (if the run has generators), then every process's
        metrics of `step`."""
        if step == self.last_step and self.sync is not None:
            await self.sync.wait()  # it starts the final eval
            if self.evaluator is not None:
                await self.evaluator.wait()  # written before the run closes its logs
        if self.generator is not None:
            await self.logs.generators(step, self.generator)
        record_metric("run/elapsed_s", time.perf_counter() - start)
        logged = await self.logs.step(step)
        self.logged = step
        return logged

    # --- the run ------------------------------------------------------------------------------

    async def run(self) -> None:
        """The app's loop: steps `version + 1 .. last_step`."""
        raise NotImplementedError

    @classmethod
    async def main(cls, cfg: RunConfig) -> None:
        """Start, run, and always close; a finished run says so and does nothing."""
        try:
            run = await cls.start(cfg)
        except RunFinished as e:  # raised before anything started
            say(str(e))
            return
        try:
            await run.run()
        finally:
            await run.close()

    async def close(self) -> None:
        """Final checkpoint (if configured), HF export (after a step), metrics, plot; then what
        the start started is closed, in reverse order."""
        try:
            if self.sync is not None:
                await self.sync.settle()
            await self._log_interrupted_step()
            self.logs.close()  # the progress bar first, so the lines below stay whole
            if self.version:
                await self.lifecycle.finish(self._final_step(), self.state_dict)
            else:
                say("no step taken: no checkpoint or export")
        finally:
            await self._exits.aclose()

    def _final_step(self) -> int | None:
        """The step the final checkpoint is of; None (saying why) where there is none."""
        if self.lifecycle.stopped_at:
            step = self.lifecycle.checkpointed
            say(f"no final checkpoint: resumed, it goes on after step {step}")
        elif self.version != self.logged:  # resumed from there, its line would be missing
            say(f"no final checkpoint: step {self.version} was not logged")
        else:
            return self.version
        return None

    async def _log_interrupted_step(self) -> None:
        """Logs a step that trained but was stopped before its line (Ctrl-C, or a failure in
        its weight update), so that the final checkpoint is of a step the metrics show. A step
        the divergence guard stopped the run at said so already, and gets no checkpoint."""
        if self.version == self.logged or self.lifecycle.stopped_at:
            return
        try:
            await self.log_step(self.version, self.started)
        except Exception as e:
            say(f"step {self.version} trained, but its metrics could not be logged: {e}")
