"""The placement plan: which hosts, GPUs and cores every proc mesh of a run gets, checked
before any process starts.

`place_roles(roles, shape, choice)` takes a run's roles (trainer, generator replicas, reward, and
what the app adds) in the order the Provisioner places them, and places each on simulated
hosts of the cluster's shape with the Provisioner's own `place`, so the plan is what the run
will get. An impossible request is refused with one line naming the config keys at fault
(forge.loop.plan adds the checks that read the run's config).

Colocated placement puts trainer and generator in one device group (reserved first), each
seeing all of it; the other roles get devices of their own.
"""

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from forge.config import ConfigError
from forge.placement.devices import HostDevices, Placement, PlacementError, member_view, place
from forge.placement.roles import Resources, Role

# Where a host's GPU count comes from (ProvisionerConfig.cluster_shape), for error messages.
GPU_KEYS = "provisioner.gpus_per_host or provisioner.slurm.gpus_per_node"
GROUP = "colocated"  # the device group that colocated roles share
COLOCATED = ("trainer", "generator")

# How generator and trainer share devices: the same ones, taking turns, or each its own.
Layout = Literal["colocated", "split"]
# How a run asks for them to be placed (RunConfig.placement; docs/placement.md): a layout, or
# "auto" (start_placement).
PlacementChoice = Literal["auto", Layout]


class PlanError(ConfigError):
    """A config whose resources cannot be placed; the message names the keys at fault."""


@dataclass(frozen=True)
class ClusterShape:
    """The hosts a run gets, all alike: how many, and the GPUs and cores of each."""

    hosts: int
    gpus_per_host: int
    cpus_per_host: int

    def devices(self) -> list[HostDevices]:
        """Simulated hosts, named and numbered as the Provisioner numbers the real ones."""
        cpus = tuple(range(self.cpus_per_host))
        return [HostDevices(f"host{i}", self.gpus_per_host, cpus) for i in range(self.hosts)]

    def __str__(self) -> str:
        return (
            f"{self.hosts} host{'s' * (self.hosts != 1)} x "
            f"{self.gpus_per_host} GPUs, {self.cpus_per_host} cores"
        )


@dataclass(frozen=True)
class Mesh:
    """One placed proc mesh: a role's replica and the devices it owns."""

    role: Role
    replica: int
    placement: Placement


@dataclass(frozen=True)
class Plan:
    """Every proc mesh of a run, in placement order, on a cluster of `shape`.

    `placement` is how generator and trainer start ("colocated": in `group`, shared), and
    `reason` why, for the start-up line.
    """

    shape: ClusterShape
    roles: tuple[Role, ...]  # as placed: colocated ones in `group`, sized to it
    meshes: tuple[Mesh, ...]
    free: tuple[HostDevices, ...]  # what no mesh reserved
    placement: Layout = "split"
    reason: str = ""
    group: Placement | None = None
    auto: bool = False  # `placement: auto`: a calibration may re-divide the devices

    @property
    def colocated(self) -> bool:
        """Whether generator and trainer start on the same devices, taking turns."""
        return self.placement == "colocated"

    def role(self, name: str) -> Role:
        """Role `name` as placed."""
        return next(r for r in self.roles if r.name == name)

    def of_role(self, name: str) -> list[Placement]:
        """The placements of role `name`'s replicas."""
        return [m.placement for m in self.meshes if m.role.name == name]

    def resources(self, name: str) -> Resources:
        """Role `name`'s resources as placed (colocation sizes them to the group)."""
        return next(m.role.resources for m in self.meshes if m.role.name == name)

    def table(self) -> str:
        """The cluster's shape; one row per role: replicas, hosts, procs per host, GPUs and
        cores (ids per host, over all replicas; "any": not pinned), processes per replica;
        then the devices no mesh reserved."""
        header = ("role", "replicas", "hosts", "procs/host", "GPUs", "cores", "world")
        roles = dict.fromkeys(m.role.name for m in self.meshes)
        rows = [header, *(self._row(name) for name in roles)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        free = (f"{h.name} {len(h.free_gpus)} GPUs/{len(h.free_cpus)} cores" for h in self.free)
        return "\n".join(
            [
                f"cluster: {self.shape}",
                f"placement: {self.placement} ({self.reason})",
                *(line.rstrip() for line in lines),
                "not reserved: " + ", ".join(free),
            ]
        )

    def _row(self, name: str) -> tuple[str, ...]:
        meshes = [m for m in self.meshes if m.role.name == name]
        first = meshes[0].placement
        hosts = sorted({h for m in meshes for h in m.placement.hosts})
        cores = "any" if not first.cpus[0] else _per_host(meshes, lambda p: p.cpus)
        return (
            name,
            str(len(meshes)),
            _ranges(hosts),
            str(first.procs_per_host),
            _per_host(meshes, lambda p: p.gpus) if first.gpus[0] else "-",
            cores,
            str(first.world_size),
        )


def check_roles(roles: list[Role], shape: ClusterShape) -> None:
    """Each role's mesh alone: counts that make sense, and a host that can hold it.

    Raises:
        PlanError: one line naming the config keys at fault.
    """
    for role in roles:
        _check_role(role, shape)


def place_roles(roles: list[Role], shape: ClusterShape, choice: PlacementChoice) -> Plan:
    """Places every role of `roles` (checked by `check_roles`) on a cluster of `shape` as the
    Provisioner will, generator and trainer as `choice` says, after checking that they fit
    together.

    Raises:
        PlanError: one line naming the config keys at fault.
    """
    placement, reason = start_placement(roles, shape, choice)
    hosts = shape.devices()
    group = None
    if placement == "colocated":
        roles, group = _colocate(roles, shape, hosts)
    _check_totals([r for r in roles if r.group is None], shape)
    meshes = _place_all(roles, hosts, group)
    auto = choice == "auto"
    return Plan(shape, tuple(roles), tuple(meshes), tuple(hosts), placement, reason, group, auto)


def start_placement(
    roles: list[Role], shape: ClusterShape, choice: PlacementChoice
) -> tuple[Layout, str]:
    """How generator and trainer start under `choice`, and why.

    "auto" starts colocated where its calibration can re-divide the devices at run time: CPU
    cores of one host, one generator replica, one trainer host. GPUs cannot be handed from
    one process to another that way, so "auto" keeps the configured split there.
    """
    resources = {r.name: r.resources for r in roles}
    if "generator" not in resources:
        return "split", "no generator: the trainer has its devices alone"
    if choice != "auto":
        return choice, "placement"
    g, t = resources["generator"], resources["trainer"]
    if g.with_gpus or t.with_gpus or shape.gpus_per_host:
        return "split", "auto: GPU placements are not calibrated, so the configured split"
    if (t.hosts or 1) > 1 or (g.hosts or 1) > 1 or g.num_replicas > 1:
        return "split", "auto: calibrates one generator and one trainer host only"
    return "colocated", "auto: starts on every core; an RL run's calibration may split them"


def _colocate(
    roles: list[Role], shape: ClusterShape, hosts: list[HostDevices]
) -> tuple[list[Role], Placement]:
    """Reserves the colocated group on `hosts` and sizes trainer and generator to it.

    On GPUs the group is the trainer's GPUs (one per rank) and the generators' replicas go
    on those; on CPUs it is every core no other role reserved, and each role divides it
    among its processes.
    """
    trainer = next(r for r in roles if r.name == "trainer").resources
    generator = next(r for r in roles if r.name == "generator").resources
    if trainer.with_gpus != generator.with_gpus:
        raise PlanError(
            "placement colocated needs trainer_resources.with_gpus and "
            "generator_resources.with_gpus alike: the two take turns on the same devices"
        )
    others = [r for r in roles if r.name not in COLOCATED]
    reserved = sum(r.resources.procs * r.resources.cpus_per_proc for r in others)
    cores = 0 if trainer.with_gpus else shape.cpus_per_host - reserved
    gpus = trainer.procs if trainer.with_gpus else 0
    if not trainer.with_gpus and cores < max(trainer.procs, generator.num_replicas):
        raise PlanError(
            f"placement colocated: {cores} cores left after the other roles' "
            "cpus_per_proc, fewer than the trainer's or generators' processes"
        )
    try:
        group = place(
            hosts,
            num_hosts=trainer.hosts or 1,
            procs_per_host=1,
            gpus_per_proc=gpus,
            cpus_per_proc=cores,
        )
    except PlacementError as e:
        raise PlanError(f"placement colocated: {e}") from None
    generator_procs = generator.num_replicas * generator.procs
    sized = {
        "trainer": dataclasses.replace(trainer, cpus_per_proc=cores // trainer.procs),
        "generator": dataclasses.replace(generator, cpus_per_proc=cores // generator_procs),
    }
    placed = [
        dataclasses.replace(r, resources=sized[r.name], group=GROUP) if r.name in sized else r
        for r in roles
    ]
    return placed, group


def _check_role(role: Role, shape: ClusterShape) -> None:
    """One mesh of `role` alone: counts that make sense, and a host that can hold it."""
    r, key = role.resources, _key(role)
    hosts = 1 if r.hosts is None else r.hosts
    for name, value, least in (
        ("procs", r.procs, 1),
        ("num_replicas", r.num_replicas, 1),
        ("hosts", hosts, 1),
        ("cpus_per_proc", r.cpus_per_proc, 0),
    ):
        if value < least:
            raise PlanError(f"{key}.{name} must be >= {least}, got {value}")
    if hosts > shape.hosts:
        raise PlanError(
            f"{key}.hosts {hosts} > provisioner.hosts {shape.hosts}: the mesh would span more "
            "hosts than the cluster has"
        )
    if r.with_gpus and not shape.gpus_per_host:
        raise PlanError(
            f"{key}.with_gpus is true, but the cluster's hosts have no GPUs "
            f"({GPU_KEYS}, or none found here)"
        )
    if r.with_gpus and r.procs > shape.gpus_per_host:
        raise PlanError(
            f"{key}.procs {r.procs} (one GPU each) > {shape.gpus_per_host} GPUs per host "
            f"({GPU_KEYS}): spread it with {key}.hosts"
        )
    if r.procs * r.cpus_per_proc > shape.cpus_per_host:
        raise PlanError(
            f"{key}.procs {r.procs} x {key}.cpus_per_proc {r.cpus_per_proc} cores > "
            f"{shape.cpus_per_host} cores per host (provisioner.cpus_per_host)"
        )


def _check_totals(roles: list[Role], shape: ClusterShape) -> None:
    """All meshes together against the whole cluster: GPUs, then reserved cores."""
    for unit, per_host, need in (
        ("GPUs", shape.gpus_per_host, lambda r: r.procs * r.with_gpus),
        ("cores", shape.cpus_per_host, lambda r: r.procs * r.cpus_per_proc),
    ):
        asks = {
            _key(role): need(role.resources)
            * (role.resources.hosts or 1)
            * role.resources.num_replicas
            for role in roles
        }
        asks = {k: n for k, n in asks.items() if n}
        total = per_host * shape.hosts
        if sum(asks.values()) > total:
            parts = " + ".join(f"{k} {n}" for k, n in asks.items())
            raise PlanError(
                f"{parts} = {sum(asks.values())} {unit} > the cluster's {total} "
                f"({shape.hosts} hosts x {per_host}; provisioner.hosts): the meshes would overlap"
            )


def _place_all(roles: list[Role], hosts: list[HostDevices], group: Placement | None) -> list[Mesh]:
    """Every replica of every role, placed in order on `hosts` as the Provisioner does; a
    grouped role in its own view of the group."""
    meshes: list[Mesh] = []
    for role in roles:
        r = role.resources
        devices = hosts if role.group is None else member_view(hosts, group)
        for replica in range(r.num_replicas):
            try:
                placement = place(
                    devices,
                    num_hosts=r.hosts or 1,
                    procs_per_host=r.procs,
                    gpus_per_proc=1 if r.with_gpus else 0,
                    cpus_per_proc=r.cpus_per_proc,
                )
            except PlacementError as e:
                before = ", ".join(dict.fromkeys(_key(m.role) for m in meshes))
                raise PlanError(
                    f"{_key(role)}: replica {replica} does not fit on "
                    f"{r.hosts or 1} adjacent host(s) after {before or 'nothing'}: {e}"
                ) from None
            meshes.append(Mesh(role, replica, placement))
    return meshes


def _key(role: Role) -> str:
    """What errors call a role: its config key, or its name where the app fixes it."""
    return role.key or role.name


def _per_host(
    meshes: Iterable[Mesh], ids: Callable[[Placement], tuple[tuple[int, ...], ...]]
) -> str:
    """`host0: 0-3, host1: 0-7`: the device ids the meshes own, per host."""
    owned: dict[int, set[int]] = {}
    for m in meshes:
        for host, got in zip(m.placement.hosts, ids(m.placement), strict=True):
            owned.setdefault(host, set()).update(got)
    return ", ".join(f"host{h}: {_ranges(sorted(owned[h]))}" for h in sorted(owned))


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
