"""The Provisioner: places proc meshes on hosts and stops everything it started.

Three launchers give it hosts (`ProvisionerConfig.launcher`): `local` (this machine,
`this_host()`), `process` (several hosts emulated on this machine by `monarch.job.ProcessJob`,
for multi-host tests), both in hosts.py, and `slurm` (`monarch.job.SlurmJob`; inside a job that
`forge submit` started, the nodes of that job), in slurm/launcher.py. Each proc mesh gets its
own devices (see forge/placement/devices.py).
"""

import asyncio
import logging
import os
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, get_args

import monarch.actor
from monarch.actor import HostMesh, ProcMesh, default_bootstrap_cmd

from forge.config import at_least, positive
from forge.controller.hosts import HostLauncher, LocalLauncher, ProcessLauncher
from forge.controller.library_output import library_output_by_default
from forge.controller.monarch_compat import stop_proc_mesh, tolerate_starved_processes
from forge.controller.slurm.config import SlurmConfig
from forge.controller.slurm.launcher import SlurmLauncher
from forge.placement.devices import (
    HostDevices,
    Placement,
    member_view,
    place,
    proc_env,
    release,
)
from forge.placement.plan import ClusterShape

logger = logging.getLogger(__name__)

Launcher = Literal["local", "process", "slurm"]


@dataclass
class ProvisionerConfig:
    """Where proc meshes run.

    Args:
        launcher: "local", "process" or "slurm" (see `host_launcher`).
        hosts: hosts to emulate ("process") or nodes to allocate ("slurm"); "local" has one.
        gpus_per_host: None counts the GPUs torch sees here (or slurm.gpus_per_node).
        cpus_per_host: None uses the cores this process may run on.
        stop_timeout_s: how long stopping a proc mesh may take before it counts as failed
            (Monarch's stop can wait forever, e.g. on a host whose agent died).
        slurm: what to ask SLURM for (SlurmConfig): the slurm launcher's and `forge submit`'s.
    """

    launcher: Launcher = "local"
    hosts: int = 1
    gpus_per_host: int | None = None
    cpus_per_host: int | None = None
    stop_timeout_s: float = 60.0
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        at_least(self, 0, "gpus_per_host")
        at_least(self, 1, "cpus_per_host")
        positive(self, "stop_timeout_s")
        self.host_launcher()  # refuses an unknown launcher, or hosts it cannot have

    def host_launcher(self) -> HostLauncher:
        """A new launcher of the kind `launcher` names, for `hosts` hosts: the one place that
        reads the name. Its constructor refuses hosts it cannot have (ValueError)."""
        match self.launcher:
            case "local":
                return LocalLauncher(self.hosts)
            case "process":
                return ProcessLauncher(self.hosts)
            case "slurm":
                return SlurmLauncher(self.hosts, self.slurm)
        raise ValueError(f"launcher must be one of {get_args(Launcher)}, got {self.launcher!r}")

    @property
    def nodes(self) -> int:
        """The nodes a run needs: the hosts of a launcher whose hosts are separate machines
        (slurm); the others run on one."""
        return self.hosts if self.host_launcher().spans_nodes else 1

    def cluster_shape(self) -> ClusterShape:
        """The hosts the Provisioner sees: `gpus_per_host` (else SLURM's `gpus_per_node`, else
        the GPUs torch finds here) and `cpus_per_host` (else the cores this process may run on,
        which the Provisioner also takes for every host)."""
        gpus = self.gpus_per_host
        if gpus is None:
            gpus = self.host_launcher().gpus_per_host()
        cpus = self.cpus_per_host
        if cpus is None:
            cpus = len(os.sched_getaffinity(0))
        return ClusterShape(self.hosts, gpus, cpus)


@dataclass
class ProcessConfig:
    """The processes one actor (or one service replica) runs on.

    Args:
        procs: processes per host.
        hosts: hosts to span; None means one.
        with_gpus: give each process `gpus_per_proc` GPUs of its own.
        cpus_per_proc: cores reserved for each process (pinned, and its thread count);
            0 shares the host's unreserved cores.
        env: extra environment variables for every process.
        mesh_name: a name for the proc mesh, for logs; meshes of one name share a group's
            view (a service's replicas).
        group: a device group (`Provisioner.reserve_group`) to place the procs in, shared
            with the group's other meshes (colocation); None: devices of their own.
    """

    procs: int = 1
    hosts: int | None = None
    with_gpus: bool = False
    gpus_per_proc: int = 1
    cpus_per_proc: int = 0
    env: dict[str, str] = field(default_factory=dict)
    mesh_name: str | None = None
    group: str | None = None


class Stoppable(Protocol):
    async def shutdown(self) -> None: ...


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name if it has none."""
    return (str(error).splitlines() or [type(error).__name__])[0]


class HostLostError(RuntimeError):
    """A host of the run no longer answers: what ran there cannot be respawned there."""


def _log_fault(failure: Any) -> None:
    # Monarch's default hook exits the driver when any actor's process dies. Services detect
    # and repair dead replicas themselves (and count them), a plain actor's caller gets the
    # error, and stopping a mesh at shutdown reports its actors as failed too: a record in the
    # log, not a console warning.
    logger.info("monarch fault: %s", first_line(failure))


class Provisioner:
    """Hands out proc meshes on the configured hosts and stops them all at `shutdown`."""

    def __init__(self, cfg: ProvisionerConfig | None = None) -> None:
        self.cfg = cfg or ProvisionerConfig()
        self._launcher = self.cfg.host_launcher()
        self._host_mesh: HostMesh | None = None
        self._devices: list[HostDevices] = []
        # name -> the group's placement, and each member mesh name's view of its devices
        self._groups: dict[str, tuple[Placement, dict[str, list[HostDevices]]]] = {}
        self._meshes: dict[int, tuple[ProcMesh, Placement, str, list[HostDevices]]] = {}
        self._owned: list[Stoppable] = []
        self._actors: dict[int, ProcMesh] = {}
        self._lost: dict[int, HostLostError] = {}  # hosts check_hosts found gone, and why
        self._lock = asyncio.Lock()
        self.placed = 0  # proc meshes placed so far, in the order they asked
        self._placed_more = asyncio.Condition()
        monarch.actor.unhandled_fault_hook = _log_fault
        tolerate_starved_processes()
        library_output_by_default()  # before any process inherits the kernel's descriptors
        self._launcher.prepare()

    def _start_hosts(self) -> None:
        cfg = self.cfg
        self._host_mesh, names = self._launcher.start()
        gpus = cfg.cluster_shape().gpus_per_host
        cpus = tuple(sorted(os.sched_getaffinity(0)))
        if cfg.cpus_per_host is not None:
            cpus = tuple(range(cfg.cpus_per_host))
        self._devices = [HostDevices(name, gpus, cpus) for name in names]

    async def reserve_group(self, name: str, *, hosts: int, gpus: int, cpus: int) -> Placement:
        """Reserves `gpus` GPUs and `cpus` cores on each of `hosts` hosts for meshes that
        share them (`ProcessConfig.group`): colocated roles, which take turns on them.

        Raises PlacementError when they are not free.
        """
        async with self._lock:
            if self._host_mesh is None:
                self._start_hosts()
            if name in self._groups:
                raise ValueError(f"device group {name!r} is already reserved")
            group = place(
                self._devices,
                num_hosts=hosts,
                procs_per_host=1,
                gpus_per_proc=gpus,
                cpus_per_proc=cpus,
            )
            self._groups[name] = (group, {})
            return group

    def _devices_for(self, pc: ProcessConfig) -> list[HostDevices]:
        if pc.group is None:
            return self._devices
        if pc.group not in self._groups:
            raise ValueError(f"device group {pc.group!r} is not reserved (reserve_group)")
        group, views = self._groups[pc.group]
        return views.setdefault(pc.mesh_name or "unnamed", member_view(self._devices, group))

    async def spawn_procs(self, pc: ProcessConfig) -> ProcMesh:
        """Starts a proc mesh with its own devices (or its group's), as `pc` asks."""
        async with self._lock:
            if self._host_mesh is None:
                self._start_hosts()
            devices = self._devices_for(pc)
            placement = place(
                devices,
                num_hosts=pc.hosts or 1,
                procs_per_host=pc.procs,
                gpus_per_proc=pc.gpus_per_proc if pc.with_gpus else 0,
                cpus_per_proc=pc.cpus_per_proc,
            )
            self.placed += 1
            async with self._placed_more:
                self._placed_more.notify_all()
        try:
            hosts = self._launcher.select(self._host_mesh, placement.hosts)
            addr, port = await self._launcher.rendezvous(hosts)
            placement = replace(placement, master_addr=addr, master_port=port)
            gpu_host = self._devices[placement.hosts[0]].gpus > 0

            def command(point: Any) -> Any:
                env = {**pc.env, **proc_env(placement, point.rank, gpu_host=gpu_host)}
                return default_bootstrap_cmd().with_env(env)

            mesh = hosts.spawn_procs(
                per_host={"procs": pc.procs}, name=pc.mesh_name, bootstrap_command=command
            )
            await mesh.initialized
        except BaseException:
            release(devices, placement)
            raise
        self._meshes[id(mesh)] = (mesh, placement, pc.mesh_name or "unnamed", devices)
        return mesh

    async def wait_placed(self, count: int) -> None:
        """Returns once `count` proc meshes have been placed (`placed`), started or not."""
        async with self._placed_more:
            await self._placed_more.wait_for(lambda: self.placed >= count)

    async def stop_procs(self, mesh: ProcMesh) -> None:
        """Stops a proc mesh started by `spawn_procs` and frees its devices.

        A mesh whose processes already died stops without error; one on a host that
        `check_hosts` found lost is only forgotten. If the stop fails, its
        processes may still run: the mesh keeps its devices (no other mesh gets them), stays
        counted in `num_procs`, a warning says so, and a later call (`shutdown` makes one)
        tries again.
        """
        # Taken out before the stop is awaited: a second call meanwhile (a failed start's
        # cleanup beside the run's close) finds nothing to stop or release.
        entry = self._meshes.pop(id(mesh), None)
        if entry is None:
            return
        _, placement, name, devices = entry
        if self._lost.keys() & set(placement.hosts):
            # No answer would come from there. Its processes on the lost host went with it;
            # any elsewhere end with the workers' step at shutdown. The devices stay reserved,
            # so that nothing else is placed on a lost host.
            logger.info("proc mesh %s not stopped: its host was lost", name)
            return
        try:
            async with asyncio.timeout(self.cfg.stop_timeout_s):
                await stop_proc_mesh(mesh)
        except Exception as e:
            cause = (
                f"no answer in {self.cfg.stop_timeout_s}s"
                if isinstance(e, TimeoutError)
                else first_line(e)
            )
            logger.warning(
                "proc mesh %s failed to stop (%s); its processes may still run, so its "
                "devices stay reserved (%s)",
                name,
                cause,
                self._describe(placement),
            )
            self._meshes[id(mesh)] = entry
            return
        release(devices, placement)

    def _describe(self, placement: Placement) -> str:
        hosts = zip(placement.hosts, placement.gpus, placement.cpus, strict=True)
        return "; ".join(
            f"{self._devices[h].name}: GPUs {list(g)}, cores {list(c)}" for h, g, c in hosts
        )

    async def check_hosts(self, mesh: Any) -> None:
        """Raises HostLostError if a host that `mesh` (a proc mesh or an `as_actor` handle)
        runs on no longer answers. Only workers this provisioner started on the nodes of its
        own SLURM job (`forge submit`) are probed; other hosts pass unchecked
        (`HostLauncher.lost`).
        """
        entry = self._meshes.get(id(self._actors.get(id(mesh), mesh)))
        if entry is None:
            return
        for h in entry[1].hosts:
            if h not in self._lost:  # once lost, lost for good: it is not probed again
                why = await self._launcher.lost(h)
                if why is None:
                    continue
                self._lost[h] = HostLostError(why)
            raise self._lost[h]

    async def probing_hosts(self, call: Awaitable[Any], mesh: Any, every_s: float) -> Any:
        """Awaits `call`, probing the hosts `mesh` runs on (`check_hosts`) every `every_s`
        meanwhile: Monarch reports a lost host's processes dead only minutes later.

        Raises:
            HostLostError: a host was lost first; the call is cancelled.
        """
        pending = asyncio.ensure_future(call)
        try:
            while not (await asyncio.wait({pending}, timeout=every_s))[0]:
                await self.check_hosts(mesh)
            return pending.result()
        finally:
            pending.cancel()

    def track_actor(self, actor: Any, mesh: ProcMesh) -> None:
        """Remembers which proc mesh an `as_actor` handle runs on, for `stop_actor`."""
        self._actors[id(actor)] = mesh

    async def stop_actor(self, actor: Any) -> None:
        """Stops the processes of an actor made by `as_actor`."""
        mesh = self._actors.pop(id(actor), None)
        if mesh is None:
            raise ValueError("this actor was not started by as_actor, or is already stopped")
        await self.stop_procs(mesh)

    def own(self, thing: Stoppable) -> None:
        """Registers a service or actor to be shut down with the provisioner."""
        self._owned.append(thing)

    def disown(self, thing: Stoppable) -> None:
        if thing in self._owned:
            self._owned.remove(thing)

    def placements(self) -> list[tuple[str, list[str]]]:
        """Each running proc mesh's name and the names of the hosts it runs on (`host0`, ...;
        SLURM node names inside a `forge submit` job), in start order."""
        return [
            (name, [self._devices[h].name for h in p.hosts])
            for _, p, name, _ in self._meshes.values()
        ]

    @property
    def num_procs(self) -> int:
        """Processes currently started by this provisioner (for tests and metrics)."""
        return sum(p.world_size for _, p, _, _ in self._meshes.values())

    async def shutdown(self) -> None:
        """Stops every service, actor and proc mesh started here, then the hosts' job.

        Everything stops at once (a vLLM engine alone takes seconds to exit); an error is
        raised once the rest has stopped.
        """
        actors = list(self._actors.values())  # meshes of `as_actor` handles: no service's
        stopped = await asyncio.gather(
            *(thing.shutdown() for thing in self._owned),
            *(self.stop_procs(mesh) for mesh in actors),
            return_exceptions=True,
        )
        self._owned.clear()
        self._actors.clear()
        await asyncio.gather(*(self.stop_procs(mesh) for mesh, *_ in list(self._meshes.values())))
        for group, _ in self._groups.values():
            release(self._devices, group)
        self._groups.clear()
        await self._launcher.stop()
        self._host_mesh = None
        errors = [e for e in stopped if isinstance(e, BaseException)]
        if errors:
            raise errors[0]


_provisioner: Provisioner | None = None


def init_provisioner(cfg: ProvisionerConfig | None = None) -> Provisioner:
    """Sets up the process-wide provisioner; call before spawning anything."""
    global _provisioner
    if _provisioner is not None:
        raise RuntimeError("the provisioner is already initialised; call shutdown() first")
    _provisioner = Provisioner(cfg)
    return _provisioner


def get_provisioner() -> Provisioner:
    """The process-wide provisioner, a local one if none was initialised."""
    global _provisioner
    if _provisioner is None:
        _provisioner = Provisioner()
    return _provisioner


async def shutdown() -> None:
    """Stops everything the process-wide provisioner started; no process outlives it."""
    global _provisioner
    if _provisioner is not None:
        await _provisioner.shutdown()
        _provisioner = None
