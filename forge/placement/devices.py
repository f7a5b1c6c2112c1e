"""Device assignment: which GPUs or CPU cores each process of a proc mesh owns.

Plain code with no Monarch in it, so the assignment logic is unit-tested with fake device
counts. The plan (`plan.py`) places a run's roles with it on simulated hosts, and the
Provisioner on the real ones, turning a `Placement` into per-process environment variables.
"""

from dataclasses import dataclass, field


class PlacementError(RuntimeError):
    """Raised when a request cannot be placed on the free devices."""


@dataclass
class HostDevices:
    """The devices of one host, and which of them are taken.

    Args:
        name: host label, for error messages.
        gpus: number of GPUs on the host.
        cpus: usable CPU core ids on the host.
    """

    name: str
    gpus: int
    cpus: tuple[int, ...]
    free_gpus: list[int] = field(init=False)
    free_cpus: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.free_gpus = list(range(self.gpus))
        self.free_cpus = list(self.cpus)

    def take(self, gpus: int, cpus: int) -> tuple[list[int], list[int]]:
        """Reserves `gpus` GPUs and `cpus` cores, lowest ids first."""
        if gpus > len(self.free_gpus) or cpus > len(self.free_cpus):
            raise PlacementError(
                f"host {self.name}: asked for {gpus} GPUs and {cpus} cores, "
                f"free are {len(self.free_gpus)} GPUs and {len(self.free_cpus)} cores"
            )
        got_gpus, self.free_gpus = self.free_gpus[:gpus], self.free_gpus[gpus:]
        got_cpus, self.free_cpus = self.free_cpus[:cpus], self.free_cpus[cpus:]
        return got_gpus, got_cpus

    def give_back(self, gpus: list[int], cpus: list[int]) -> None:
        """Returns devices reserved by `take`."""
        self.free_gpus = sorted(set(self.free_gpus) | set(gpus))
        self.free_cpus = sorted(set(self.free_cpus) | set(cpus))


@dataclass(frozen=True)
class Placement:
    """Where one proc mesh runs: a run of hosts, and per host the devices its procs share."""

    hosts: tuple[int, ...]
    procs_per_host: int
    gpus: tuple[tuple[int, ...], ...]  # per host
    cpus: tuple[tuple[int, ...], ...]  # per host
    master_addr: str = "localhost"
    master_port: int = 29500

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.procs_per_host


def place(
    hosts: list[HostDevices],
    *,
    num_hosts: int,
    procs_per_host: int,
    gpus_per_proc: int,
    cpus_per_proc: int,
) -> Placement:
    """Reserves devices for a proc mesh on the first run of `num_hosts` hosts that fits.

    Raises PlacementError, naming the request, when no run of hosts has room.
    """
    need_gpus, need_cpus = procs_per_host * gpus_per_proc, procs_per_host * cpus_per_proc
    for start in range(len(hosts) - num_hosts + 1):
        run = hosts[start : start + num_hosts]
        if all(len(h.free_gpus) >= need_gpus and len(h.free_cpus) >= need_cpus for h in run):
            taken = [h.take(need_gpus, need_cpus) for h in run]
            return Placement(
                hosts=tuple(range(start, start + num_hosts)),
                procs_per_host=procs_per_host,
                gpus=tuple(tuple(g) for g, _ in taken),
                cpus=tuple(tuple(c) for _, c in taken),
            )
    raise PlacementError(
        f"cannot place {procs_per_host} procs per host needing {need_gpus} GPUs and "
        f"{need_cpus} cores on each of {num_hosts} host(s); free: "
        + ", ".join(f"{h.name} {len(h.free_gpus)} GPUs/{len(h.free_cpus)} cores" for h in hosts)
    )


def member_view(hosts: list[HostDevices], group: Placement) -> list[HostDevices]:
    """The hosts as one member of a device group sees them: the group's devices, all free, and
    nothing else.

    Colocated meshes (a trainer and its generators) each place their procs in a view of their
    own, so they share the group's devices with each other and with no other mesh.
    """
    views = [HostDevices(h.name, 0, ()) for h in hosts]
    for i, host in enumerate(group.hosts):
        views[host].free_gpus = list(group.gpus[i])
        views[host].free_cpus = list(group.cpus[i])
    return views


def release(hosts: list[HostDevices], placement: Placement) -> None:
    """Gives back the devices a `place` call reserved."""
    for i, host in enumerate(placement.hosts):
        hosts[host].give_back(list(placement.gpus[i]), list(placement.cpus[i]))


def proc_env(placement: Placement, rank: int, *, gpu_host: bool) -> dict[str, str]:
    """Environment of the proc with global `rank` in a mesh placed by `placement`.

    Every proc on a host sees the GPUs its mesh owns there and picks its own by LOCAL_RANK,
    as torchrun does. On a GPU host, a proc that owns no GPU sees none, so it cannot grab
    one by accident. Owned CPU cores become FORGE_CPUS (applied by `cores.apply_forge_cpus`)
    and the thread count, so pools never oversubscribe their cores.
    """
    host_index, local_rank = divmod(rank, placement.procs_per_host)
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(placement.world_size),
        "LOCAL_WORLD_SIZE": str(placement.procs_per_host),
        "MASTER_ADDR": placement.master_addr,
        "MASTER_PORT": str(placement.master_port),
    }
    gpus = placement.gpus[host_index]
    if gpus or gpu_host:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    cpus = placement.cpus[host_index]
    if cpus:
        per_proc = len(cpus) // placement.procs_per_host
        mine = cpus[local_rank * per_proc : (local_rank + 1) * per_proc]
        env["FORGE_CPUS"] = ",".join(map(str, mine))
        env["OMP_NUM_THREADS"] = str(len(mine))
    return env
