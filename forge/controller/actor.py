"""ForgeActor: a Monarch actor that knows how to place itself, alone or as a service.

    actor = await Trainer.options(procs=2, with_gpus=True).as_actor(cfg)
    gen = await Generator.options(num_replicas=4).as_service(cfg)
    await Trainer.shutdown(actor)

Heavy initialisation belongs in the async `setup` endpoint, which `as_actor` and every service
replica (also a respawned one) await before the actor takes traffic: an error there reaches
the caller instead of killing a process silently. Monarch 0.7 refuses an actor class that mixes
`def` and `async def` endpoints, and the base endpoints here are async, so subclasses write
`async def` endpoints too.
"""

import os
from dataclasses import dataclass, replace
from typing import Any

from monarch.actor import Actor, ProcMesh, endpoint

from forge.controller.provisioner import ProcessConfig, get_provisioner
from forge.controller.service import Service, ServiceConfig
from forge.observability.metrics import Accumulator, drain_local
from forge.observability.startup import booted, phase
from forge.placement.cores import apply_forge_cpus, move_to_cores, process_cores


class ForgeActor(Actor):
    """Base class of every forge actor.

    Pins the process to its cores (if the provisioner reserved any) before anything else
    runs, and offers `setup` (heavy initialisation), `ping` (health checks) and
    `flush_metrics` (what `record_metric` buffered in its process).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        apply_forge_cpus()
        super().__init__(*args, **kwargs)
        booted(type(self).__name__)

    @endpoint
    async def setup(self) -> None:
        """Heavy initialisation (load a model, start an engine). Override it."""

    @endpoint
    async def ping(self) -> int:
        """Health check; returns the process id."""
        return os.getpid()

    @endpoint
    async def use_cores(self, cpus: list[int]) -> list[int]:
        """Moves this process onto `cpus` (affinity and thread count); returns its cores."""
        return move_to_cores(cpus)

    @endpoint
    async def cores(self) -> dict[str, Any]:
        """This process's pid, cores and thread count (one entry per process it runs)."""
        import torch

        return process_cores(torch.get_num_threads())

    @endpoint
    async def flush_metrics(self) -> dict[str, Accumulator]:
        """Returns and clears the metrics its process recorded; `MetricLogger` calls it."""
        return drain_local()

    @classmethod
    def options(
        cls,
        *,
        procs: int = 1,
        hosts: int | None = None,
        with_gpus: bool = False,
        num_replicas: int = 1,
        env: dict[str, str] | None = None,
        mesh_name: str | None = None,
        **more: Any,
    ) -> "ActorOptions":
        """Pre-configures placement (and, for services, replication) of this actor.

        Extra keyword arguments go to `ProcessConfig` (gpus_per_proc, cpus_per_proc, group) or
        `ServiceConfig` (max_concurrent, routing, health_interval_s, ...).
        """
        proc_keys = {"gpus_per_proc", "cpus_per_proc", "group"}
        process = ProcessConfig(
            procs=procs,
            hosts=hosts,
            with_gpus=with_gpus,
            env=dict(env or {}),
            mesh_name=mesh_name,
            **{k: v for k, v in more.items() if k in proc_keys},
        )
        service = ServiceConfig(
            num_replicas=num_replicas, **{k: v for k, v in more.items() if k not in proc_keys}
        )
        return ActorOptions(cls, process, service)

    @classmethod
    async def as_actor(cls, *args: Any, **kwargs: Any) -> Any:
        """Spawns this actor with default options; see `ActorOptions.as_actor`."""
        return await cls.options().as_actor(*args, **kwargs)

    @classmethod
    async def as_service(cls, *args: Any, **kwargs: Any) -> Service:
        """Spawns this actor as a one-replica service; see `ActorOptions.as_service`."""
        return await cls.options().as_service(*args, **kwargs)

    @classmethod
    async def shutdown(cls, actor: Any) -> None:
        """Stops an actor made by `as_actor` and its processes."""
        await get_provisioner().stop_actor(actor)


@dataclass(frozen=True)
class ActorOptions:
    """An actor class with its placement and service settings, ready to spawn."""

    actor_cls: type[ForgeActor]
    process: ProcessConfig
    service: ServiceConfig

    async def launch(self, *args: Any, **kwargs: Any) -> tuple[Any, ProcMesh]:
        """Starts processes, spawns the actor on every one and awaits its `setup`."""
        provisioner = get_provisioner()
        name = self.process.mesh_name or self.actor_cls.__name__
        role = self.actor_cls.__name__
        with phase(role, "spawn processes"):
            mesh = await provisioner.spawn_procs(replace(self.process, mesh_name=name))
        try:
            with phase(role, "spawn and setup"):  # the processes' boot, then `setup`
                actor = mesh.spawn(name, self.actor_cls, *args, **kwargs)
                await actor.setup.call()
        except BaseException:
            await provisioner.stop_procs(mesh)
            raise
        return actor, mesh

    async def as_actor(self, *args: Any, **kwargs: Any) -> Any:
        """Spawns one actor mesh (`procs` x `hosts` processes) and returns its handle.

        The handle is Monarch's: call endpoints with `.call()`, `.call_one()`, `.choose()`.
        """
        actor, mesh = await self.launch(*args, **kwargs)
        get_provisioner().track_actor(actor, mesh)
        return actor

    async def as_service(self, *args: Any, **kwargs: Any) -> Service:
        """Spawns `num_replicas` replicas behind one `Service` handle."""
        service = Service(self, args, kwargs)
        await service.start()
        return service
