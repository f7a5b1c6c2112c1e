"""Where the Provisioner's hosts come from: the `HostLauncher` protocol, the `local` and
`process` launchers, and what every launcher shares (host names, the rendezvous probe).

The `slurm` launcher is in forge/controller/slurm/launcher.py; `ProvisionerConfig.host_launcher`
picks one of the three by `provisioner.launcher`.
"""

import contextlib
import random
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from monarch.actor import Actor, HostMesh, endpoint, this_host

# Where rendezvous ports are drawn from (free_port), and how many to try there.
_FIRST_PORT = 20000
_PORT_TRIES = 50


class HostLauncher(Protocol):
    """One launcher: starts the Provisioner's hosts and answers what depends on where they are.

    Attributes:
        spans_nodes: whether the hosts are separate machines, so that a run's nodes are its
            hosts (`ProvisionerConfig.nodes`, `forge submit --nodes`).
    """

    spans_nodes: bool

    def gpus_per_host(self) -> int:
        """Each host's GPUs where `provisioner.gpus_per_host` does not say."""

    def prepare(self) -> None:
        """Readies this process to talk to the hosts, before its first Monarch proc starts."""

    def start(self) -> tuple[HostMesh, list[str]]:
        """Starts the hosts; returns their mesh and their names, in mesh order."""

    def select(self, mesh: HostMesh, hosts: Sequence[int]) -> HostMesh:
        """The part of `mesh` (from `start`) on `hosts`, consecutive host indices."""

    async def rendezvous(self, hosts: HostMesh) -> tuple[str, int]:
        """An address and a free port on the first of `hosts`, for MASTER_ADDR/MASTER_PORT."""

    async def lost(self, host: int) -> str | None:
        """Why host `host` no longer answers, in one line; None while it does, or where this
        launcher does not probe its hosts."""

    async def stop(self) -> None:
        """Stops what `start` started; nothing if it started nothing. `start` may follow."""


class LocalLauncher:
    """`local`: this machine, Monarch's `this_host()`; one host."""

    spans_nodes = False

    def __init__(self, hosts: int) -> None:
        if hosts != 1:
            raise ValueError(f"launcher 'local' has exactly one host, got hosts={hosts}")

    def gpus_per_host(self) -> int:
        return local_gpu_count()

    def prepare(self) -> None:
        pass

    def start(self) -> tuple[HostMesh, list[str]]:
        return this_host(), host_names(1)

    def select(self, mesh: HostMesh, hosts: Sequence[int]) -> HostMesh:
        return mesh  # its one host

    async def rendezvous(self, hosts: HostMesh) -> tuple[str, int]:
        return "localhost", free_port()  # this process's host is the mesh's

    async def lost(self, host: int) -> str | None:
        return None

    async def stop(self) -> None:
        pass


class ProcessLauncher:
    """`process`: `hosts` hosts emulated on this machine by `monarch.job.ProcessJob`, for
    multi-host tests."""

    spans_nodes = False

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts
        self._job: Any = None

    def gpus_per_host(self) -> int:
        return local_gpu_count()

    def prepare(self) -> None:
        pass

    def start(self) -> tuple[HostMesh, list[str]]:
        self._job = process_job(self.hosts)
        return self._job.state(cached_path=None).hosts, host_names(self.hosts)

    def select(self, mesh: HostMesh, hosts: Sequence[int]) -> HostMesh:
        return host_slice(mesh, hosts)

    async def rendezvous(self, hosts: HostMesh) -> tuple[str, int]:
        return await probe_rendezvous(hosts)

    async def lost(self, host: int) -> str | None:
        return None

    async def stop(self) -> None:
        if self._job is not None:
            self._job.kill()
            self._job = None


def process_job(hosts: int) -> Any:
    """A `monarch.job.ProcessJob` of `hosts` emulated hosts."""
    from monarch.job import ProcessJob  # here: loaded only by a run that uses it

    return ProcessJob({"hosts": hosts})


def host_names(hosts: int) -> list[str]:
    """The names of hosts that have none of their own: host0, host1, ..."""
    return [f"host{i}" for i in range(hosts)]


def host_slice(mesh: HostMesh, hosts: Sequence[int]) -> HostMesh:
    """The part of a multi-host `mesh` on `hosts`, consecutive host indices."""
    return mesh.slice(hosts=slice(hosts[0], hosts[-1] + 1))


class _HostInfo(Actor):
    """Reports a host's name and a free port there, for MASTER_ADDR/MASTER_PORT."""

    @endpoint
    async def info(self) -> tuple[str, int]:
        return socket.getfqdn(), free_port()


async def probe_rendezvous(hosts: HostMesh) -> tuple[str, int]:
    """The first of `hosts`'s name and a free port there, asked of a process started on it."""
    probe = hosts.slice(hosts=0).spawn_procs(per_host={"procs": 1}, name="hostinfo")
    try:
        return await probe.spawn("hostinfo", _HostInfo).info.call_one()
    finally:
        await probe.stop()


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range where there is room.

    The trainer's processes bind it only once they have started: a port from the ephemeral
    range (what binding port 0 gives) may meanwhile be taken by any outgoing connection on the
    host, one below it only by another explicit choice.
    """
    for port in random.sample(range(_FIRST_PORT, _ephemeral_low()), k=_PORT_TRIES):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("", port))
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the ephemeral range (Linux's default where it cannot be read)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, _FIRST_PORT + _PORT_TRIES)


def local_gpu_count() -> int:
    """The GPUs torch sees on this machine."""
    import torch  # here: loaded only where a host's GPUs are not configured

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
