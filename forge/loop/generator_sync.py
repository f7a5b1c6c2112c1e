"""Weight sync to the generators: the trainer publishes a version, every generator moves to it,
older versions are deleted; in the background while the trainer takes its next step where the
loop allows it (`overlap`)."""

import asyncio
import time
from typing import Any

from forge.loop.evaluation import Evaluator
from forge.loop.generator_handle import GeneratorHandle
from forge.loop.run_logs import RunLogs
from forge.loop.trainer_lifecycle import TrainerLifecycle
from forge.observability import record_metric
from forge.observability.console import say
from forge.placement.placer import Placer
from forge.weights.transport import WeightTransport, delete_older_than


class GeneratorSync:
    """Moves the generators to the trainer's weights.

    Args:
        generator: the generators.
        trainer: the trainer (whichever process it is now).
        transport: where versions are published (weight_sync.transport).
        placer: the cores a respawned generator moves to.
        logs: the update's phases go on the timeline.
        evaluator: told each version every generator holds (it evaluates those due), or None.
    """

    def __init__(
        self,
        generator: GeneratorHandle,
        trainer: TrainerLifecycle,
        transport: WeightTransport,
        placer: Placer,
        logs: RunLogs,
        evaluator: Evaluator | None,
    ) -> None:
        self.generator = generator
        self.trainer = trainer
        self.transport = transport
        self.placer = placer
        self.logs = logs
        self.evaluator = evaluator
        # Whether generators may move to new weights while the trainer takes its next step
        # (data one version older meanwhile); set by loops whose batches may be that old.
        self.overlap = False
        self._update: asyncio.Future | None = None  # that move, while it runs

    async def publish(self, step: int, version: int) -> float:
        """The trainer's weights, as `version`, to every generator; older versions deleted.
        Returns the seconds the trainer spent publishing them.

        With `overlap` the generators move in the background while the trainer takes its next
        step; the next publish waits for that move first, so at most two versions exist.
        `weights/sync_s` is what the loop waited.
        """
        start = time.perf_counter()
        await self.wait()
        pushing = time.perf_counter()
        published = await self.trainer.handle.push_weights(version)
        pushed = time.perf_counter()
        record_metric("weights/push_s", pushed - pushing)
        record_metric("weights/bytes", published["bytes"])
        update = self._update_generators(step, version)
        if self.overlap:
            self._update = asyncio.ensure_future(update)
        else:
            await update
        record_metric("weights/sync_s", time.perf_counter() - start)
        return pushed - pushing

    async def _update_generators(self, step: int, version: int) -> None:
        start = time.perf_counter()
        updates = await self.generator.update_weights(version)
        record_metric("weights/update_s", time.perf_counter() - start)
        if not updates:  # every generator died meanwhile (a respawn loads the newest version)
            return
        # Per generator: the version built beside the live weights (generation goes on), the
        # drain before its swap (nothing new admitted), then the swap (engine stopped); the
        # slowest generator's.
        for phase in ("prepare", "pause", "swap"):
            record_metric(f"weights/generator_{phase}_s", max(u[f"{phase}_s"] for u in updates))
        for i, u in enumerate(updates):
            if u["mode"] != "none":
                self.logs.span(step, f"generator {i}", "prepare", u["prepare_at"], u["pause_at"])
                self.logs.span(step, f"generator {i}", "pause", u["pause_at"], u["swap_at"])
                self.logs.span(step, f"generator {i}", "swap", u["swap_at"], u["end_at"])
        await delete_older_than(self.transport, version)
        if self.evaluator is not None:
            self.evaluator.updated(step, version)

    async def wait(self) -> None:
        """Returns once the generators' move to the last published version is over (raising
        its error, if it failed)."""
        if self._update is not None:
            update, self._update = self._update, None
            await update

    async def settle(self) -> None:
        """Waits for a running update at close; a failed one is reported, not raised (the
        run's own error, if any, is the one to see)."""
        try:
            await self.wait()
        except Exception as e:
            say(f"the last weight update failed: {e}")

    async def sync(self, version: int) -> None:
        """Moves every generator to the trainer's weights, `version`, even back to an older
        one (a restarted trainer); every other version is deleted."""
        await self.wait()
        await self.trainer.handle.push_weights(version)
        await self.generator.update_weights(version)
        for other in await self.transport.versions():
            if other != version:
                await self.transport.delete(other)

    async def away(self, version: int) -> None:
        """A scratch `version` of the same weights, published and taken by every generator (a
        calibration times the sync)."""
        await self.trainer.handle.push_weights(version)
        await self.generator.update_weights(version)

    async def recover(self, actor: Any) -> None:
        """A respawned generator replica catches up to the newest weights, and to the cores
        its placement moved it to, before taking traffic."""
        await actor.load_latest.call()
        if (cpus := self.placer.cores_of("generator")) is not None:
            await actor.use_cores.call(cpus)
