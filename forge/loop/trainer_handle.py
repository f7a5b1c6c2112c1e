"""The trainer as the loop calls it: one method per trainer endpoint, each called on every rank
(data-parallel ranks take part in every collective) and returning rank 0's value.

A method an editor can follow to `TitanTrainer`'s endpoint of the same name replaces a
string dispatch; a trainer process that dies during a call raises TrainerDied, which the loop
answers by respawning the trainer from its checkpoint. Every call that computes on the
trainer's devices (a step, an eval loss, logprobs, calibration, a push) takes the training turn
(forge.placement.turns), so a colocated generator never runs meanwhile, whoever calls;
checkpoints and exports copy weights out and take none, as before.
"""

from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from typing import Any

from forge.actors.trainer import TrainerConfig
from forge.controller import SupervisionError, get_provisioner
from forge.data.episode import Episode
from forge.placement.turns import Turns

# How often the hosts of a trainer call still pending are probed (as often as a service's
# health checks by default, ServiceConfig.health_interval_s).
HOST_PROBE_S = 2.0


class TrainerDied(RuntimeError):
    """The trainer's process died during a call; the run respawns it from its checkpoint."""


class TrainerHandle:
    """Calls on a running `TitanTrainer` mesh (`forge.actors.trainer`); see its endpoints.

    Args:
        mesh: the trainer's actor mesh, kept as `mesh` (metrics pulls, stopping it).
        turns: the colocated turns (the run's placer's); None: a trainer alone on its devices.
    """

    def __init__(self, mesh: Any, turns: Turns | None = None) -> None:
        self.mesh = mesh
        self.turns = turns or Turns(enabled=False)

    def turn(self) -> AbstractAsyncContextManager[None]:
        """The training turn held over several calls (a step and its weight update): the
        calls inside find it held. Each call takes it anyway, so forgetting it is safe."""
        return self.turns.training()

    async def train_step(
        self, batches: list[list[Episode]], policy_version: int | None = None, record: bool = False
    ) -> dict[str, Any]:
        async with self.turns.training():
            call = self.mesh.train_step.call(batches, policy_version, record)
            return await self._rank0(call, "train_step")

    async def params_digest(self) -> str:
        async with self.turns.training():
            return await self._rank0(self.mesh.params_digest.call(), "params_digest")

    async def load_checkpoint(self, folder: str, step: int) -> None:
        await self._rank0(self.mesh.load_checkpoint.call(folder, step), "load_checkpoint")

    async def set_optimisation(self, cfg: TrainerConfig) -> None:
        await self._rank0(self.mesh.set_optimisation.call(cfg), "set_optimisation")

    async def eval_loss(self, batches: list[list[Episode]]) -> float:
        async with self.turns.training():
            return await self._rank0(self.mesh.eval_loss.call(batches), "eval_loss")

    async def compute_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        async with self.turns.training():
            return await self._rank0(self.mesh.compute_logprobs.call(pairs), "compute_logprobs")

    async def calibrate(self, batches: list[list[Episode]]) -> dict[str, float]:
        async with self.turns.training():
            return await self._rank0(self.mesh.calibrate.call(batches), "calibrate")

    async def push_weights(self, version: int) -> dict[str, float]:
        async with self.turns.training():
            return await self._rank0(self.mesh.push_weights.call(version), "push_weights")

    async def export_hf(self, path: str, merged: bool = False) -> str:
        return await self._rank0(self.mesh.export_hf.call(path, merged), "export_hf")

    async def save_checkpoint(self, background: bool | None = None) -> float:
        return await self._rank0(self.mesh.save_checkpoint.call(background), "save_checkpoint")

    async def wait_checkpoint(self) -> None:
        await self._rank0(self.mesh.wait_checkpoint.call(), "wait_checkpoint")

    async def get_step(self) -> int:
        return await self._rank0(self.mesh.get_step.call(), "get_step")

    async def use_cores(self, cpus: list[int]) -> list[int]:
        return await self._rank0(self.mesh.use_cores.call(cpus), "use_cores")

    async def use_threads(self, threads: int) -> None:
        await self._rank0(self.mesh.use_threads.call(threads), "use_threads")

    async def cores(self) -> dict[str, Any]:
        return await self._rank0(self.mesh.cores.call(), "cores")

    async def cpus(self) -> list[int]:
        """Rank 0's cores."""
        return (await self.cores())["cpus"]

    async def pids(self) -> list[int]:
        """Every rank's process id, in rank order."""
        return [cores["pid"] for cores in await self._every_rank(self.mesh.cores.call(), "cores")]

    async def _rank0(self, call: Awaitable[Any], what: str) -> Any:
        return (await self._every_rank(call, what))[0]

    async def _every_rank(self, call: Awaitable[Any], what: str) -> list[Any]:
        """Each rank's value of a call on every rank, in rank order.

        Raises:
            TrainerDied: a trainer process died during the call.
            HostLostError: a host of the trainer stopped answering the provisioner's probe
                meanwhile (probed every HOST_PROBE_S, as a service's replicas are; Monarch
                reports a lost host's processes dead only minutes later).
        """
        try:
            values = await get_provisioner().probing_hosts(call, self.mesh, HOST_PROBE_S)
        except SupervisionError as e:  # Monarch's account of it stays attached as the cause
            raise TrainerDied(f"a trainer process died during {what}") from e
        # Not .item(procs=0): meshes on a launcher's hosts also have "hosts".
        return list(values.values())
