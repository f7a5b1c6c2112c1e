"""The trainer's life in a run: its checkpoints, its respawn from the newest one when it dies,
and the exports at the end."""

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from forge.controller import get_provisioner
from forge.controller.oom import oom_kills
from forge.data.episode import Episode
from forge.loop.config import RunConfig
from forge.loop.record.batches import BatchRecord, StepRecord
from forge.loop.record.replay import how_to_replay
from forge.loop.run_folder import RunFolder
from forge.loop.run_logs import RunLogs
from forge.loop.spawn import spawn_role
from forge.loop.trainer_handle import TrainerDied, TrainerHandle
from forge.observability import Reduce, record_metric
from forge.observability.console import say
from forge.placement.placer import Placer


class TrainerLifecycle:
    """The running trainer (`handle`), replaced by a respawn when it dies.

    Args:
        handle: the trainer as started.
        cfg: the run's config (the trainer's role, checkpoint and restart limits, exports).
        placer: where the trainer runs (a respawn moves to the same cores).
        folder: the run folder (its checkpoints, the driver's state).
        logs: whose metric sources follow a respawn.
        checkpointed: the step of the newest checkpoint.

    Attributes:
        record: the run's batch record (forge.loop.record.batches).
        stopped_at: the step the divergence guard stopped the run at (0: none).
    """

    def __init__(
        self,
        handle: TrainerHandle,
        cfg: RunConfig,
        placer: Placer,
        folder: RunFolder,
        logs: RunLogs,
        checkpointed: int,
    ) -> None:
        self.handle = handle
        self.cfg = cfg
        self.placer = placer
        self.folder = folder
        self.logs = logs
        self.checkpointed = checkpointed
        self.restarts = 0
        self.record = BatchRecord(cfg.run_dir, cfg.record)
        self.stopped_at = 0  # the step the divergence guard stopped the run at
        # The running trainer's processes and when they were known (`watch`), and the step at
        # which the OOM killer last ended one (0: never), to tell its deaths apart.
        self._pids: list[int] = []
        self._since = 0.0
        self._oom_at = 0

    async def watch(self) -> None:
        """Learns the running trainer's process ids: call after each spawn, so that a death by
        the OOM killer is told apart (`restart`)."""
        self._pids, self._since = await self.handle.pids(), time.monotonic()

    async def train(
        self, step: int, batches: list[list[Episode]], policy_version: int | None
    ) -> dict[str, float]:
        """Optimizer step `step`, `batches[r]` on data-parallel rank r; the trainer's metrics,
        also recorded under train/. The batch goes to the run's batch record."""
        recording = self.record.enabled
        start = time.perf_counter()
        metrics = await self.handle.train_step(batches, policy_version, record=recording)
        record_metric("train/call_s", time.perf_counter() - start)
        self.logs.span(step, "trainer", "train", metrics.pop("started_at"), metrics.pop("ended_at"))
        blown = metrics.pop("blown")
        if recording:
            record = StepRecord(step, policy_version, batches, **metrics.pop("record"))
            record.figures.update(metrics)
            await self.record.write_off_loop(record)
        for name, value in metrics.items():
            record_metric(f"train/{name}", value)
        if blown is not None:
            self._blew_up(step, blown)
        return metrics

    def _blew_up(self, step: int, why: str) -> None:
        """Says that the divergence guard did not apply `step`, and how to replay it; raises
        if the guard's action is to stop (the run then writes no final checkpoint: resumed,
        it takes the step again)."""
        action = self.cfg.trainer.guard.action
        replay = how_to_replay(self.record, self.folder.checkpoints, step)
        say(f"step {step} not applied: {why} (trainer.guard.action {action}); {replay}")
        if action == "stop":
            self.stopped_at = step
            raise RuntimeError(f"the divergence guard stopped the run at step {step}")

    async def checkpoint(
        self,
        step: int,
        driver_state: Callable[[], Awaitable[dict[str, Any]]],
        final: bool = False,
        asked: bool = False,
    ) -> None:
        """Checkpoints `step` if one is due (or `final`, or `asked` by an attacher): the
        driver's state, then the trainer's.

        The trainer's write goes on in the background (checkpoint.async_save) except at the
        end; `checkpoint/blocked_s` is what a periodic one cost the loop.
        """
        ckpt = self.cfg.trainer.checkpoint
        due = final or asked or (ckpt.interval and step % ckpt.interval == 0)
        if ckpt.folder is None or not due:
            return
        start = time.perf_counter()
        self.folder.save_driver_state(step, await driver_state())
        if self.checkpointed == step:  # the trainer's part is written (or being written)
            await self.handle.wait_checkpoint()
        else:
            await self.handle.save_checkpoint(background=False if final else None)
        self.checkpointed = step
        if not final:  # the final one comes after the last step's row: nothing would log it
            record_metric("checkpoint/blocked_s", time.perf_counter() - start)

    async def restart(self, error: TrainerDied, died_at: int) -> int:
        """Respawns the dead trainer from its newest checkpoint; returns that checkpoint's step
        (the steps after it are taken again).

        Raises:
            RuntimeError: the trainer died more than `max_trainer_restarts` times.
            HostLostError: its host is gone, so it cannot be respawned there.
        """
        await get_provisioner().check_hosts(self.handle.mesh)
        error = self._oom_told(error, died_at)
        self.restarts += 1
        if self.restarts > self.cfg.max_trainer_restarts:
            raise RuntimeError(
                f"{error}; not restarted: it died {self.restarts} times "
                f"(max_trainer_restarts {self.cfg.max_trainer_restarts})"
            ) from error
        start, old = time.perf_counter(), self.handle.mesh
        await get_provisioner().stop_actor(old)
        mesh = await spawn_role(self.placer.plan.role("trainer"))
        self.handle = TrainerHandle(mesh, self.placer.turns)
        if (cpus := self.placer.cores_of("trainer")) is not None:
            await self.handle.use_cores(cpus)
        self.logs.replace_source(old, mesh)
        await self.watch()
        step = self.checkpointed = await self.handle.get_step()
        redo = died_at - step
        record_metric("trainer/restarts", self.restarts, Reduce.MAX)
        record_metric("trainer/redone_steps", redo, Reduce.SUM)
        record_metric("trainer/restart_s", time.perf_counter() - start)
        say(
            f"{error}; restarted from the checkpoint of step {step} in "
            f"{time.perf_counter() - start:.0f}s ({redo} step{'s' * (redo != 1)} to redo)"
        )
        return step

    def _oom_told(self, error: TrainerDied, died_at: int) -> TrainerDied:
        """`error`, saying so if the OOM killer ended the trainer (forge.controller.oom).

        Raises:
            RuntimeError: the OOM killer ended it at `died_at` before too: a respawn would
                only die again; the line says what to change.
        """
        killed = oom_kills(self._pids, self._since)
        if not killed:
            return error
        rank, pid = next((r, p) for r, p in enumerate(self._pids) if p in killed)
        held = f"{killed[pid] / 2**30:.2f} GB"
        told = TrainerDied(f"{error}: the OOM killer ended rank {rank} (pid {pid}), holding {held}")
        if self._oom_at == died_at:
            micro = self.cfg.trainer.micro_batch_size or "0: the whole batch"
            raise RuntimeError(
                f"{told}, again at step {died_at}: not restarted. Ask less memory of it: a "
                f"smaller trainer.micro_batch_size (now {micro}) or fewer sequences a step, "
                "or give its processes more memory"
            ) from error
        self._oom_at = died_at
        return told

    async def finish(
        self, step: int | None, driver_state: Callable[[], Awaitable[dict[str, Any]]]
    ) -> None:
        """The final checkpoint (of `step`; None: none) and the exports; a dead trainer has
        nothing left to save, and says so."""
        folder = self.cfg.trainer.checkpoint.folder
        try:
            if folder and step:
                await self.checkpoint(step, driver_state, final=True)
                say(f"checkpoint: {folder} (step {step})")
            await self._export()
        except TrainerDied as e:
            say(f"{e}: no final checkpoint or export")

    async def _export(self) -> None:
        """The Hugging Face export (`export_hf`): the model, or the LoRA adapter and, with
        `export_merged`, the model it merges into."""
        if not self.cfg.export_hf:
            return
        export = Path(self.cfg.run_dir) / "hf"
        await self.handle.export_hf(str(export))
        lora = self.cfg.weight_sync.lora
        say(f"{'adapter' if lora else 'model'}: {export}")
        if lora and self.cfg.export_merged:
            merged = Path(self.cfg.run_dir) / "hf-merged"
            await self.handle.export_hf(str(merged), merged=True)
            say(f"merged model: {merged}")
