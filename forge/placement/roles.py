"""Roles: the purposes a run starts processes for, and the resources each asks for.

Plain data, so the plan places a run's roles without knowing which app or loop made them.
"""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Resources:
    """Processes for one role: how many, and which devices (see ForgeActor.options).

    Args:
        procs: processes per host.
        hosts: hosts to span; None means one.
        num_replicas: a service's replicas, each of `procs` x `hosts` processes.
        with_gpus: give each process a GPU of its own.
        cpus_per_proc: cores reserved for each process (pinned, and its thread count);
            0 shares the host's unreserved cores.
        env: extra environment variables for every process.
    """

    procs: int = 1
    hosts: int | None = None
    num_replicas: int = 1
    with_gpus: bool = False
    cpus_per_proc: int = 0
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Role:
    """One purpose a run starts processes for: what runs there and on which resources. A run's
    roles (`RunConfig.roles()`) are what the placement plan places and what `Run.start`
    spawns, in that order.

    Args:
        name: what it runs ("generator", "trainer", ...): the key of its handle.
        actor: the ForgeActor class its processes run.
        args: the arguments the actor is built with (its config).
        resources: its processes and devices.
        key: the config key that sets `resources`; None where the app fixes them.
        service: a Service of `resources.num_replicas` replicas (routed, respawned), else one
            actor mesh.
        group: a device group it shares with other roles (colocation; set by the plan).
    """

    name: str
    actor: type
    args: tuple[Any, ...]
    resources: Resources = field(default_factory=Resources)
    key: str | None = None
    service: bool = False
    group: str | None = None
