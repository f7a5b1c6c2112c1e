"""The `slurm` launcher: the nodes of a SLURM job are the Provisioner's hosts.

From a login node (or a notebook) it submits a job of its own (`monarch.job.SlurmJob`), which a
watcher cancels once this process ends; inside a job that `forge submit` started, it starts
workers on that job's nodes instead (`AllocationWorkers`), and probes them for lost nodes.
"""

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from monarch.actor import HostMesh

from forge.controller.hosts import host_names, host_slice, probe_rendezvous
from forge.controller.slurm.compat import cancel_with_driver, configure_transport, patch_slurm_job
from forge.controller.slurm.config import SlurmConfig
from forge.controller.slurm.submit import AllocationWorkers, in_allocation

# How long a node's Monarch worker may take to accept a connection before the node counts as
# lost (SlurmLauncher.lost).
HOST_PROBE_TIMEOUT_S = 5.0
# The pause between the two probes that must both fail (a worker restarting its listener, a
# dropped packet: not a lost node).
HOST_PROBE_PAUSE_S = 1.0
# How long the job's watcher may take to cancel it at shutdown (an scancel).
STOP_WATCHER_TIMEOUT_S = 30.0


class SlurmLauncher:
    """`slurm`: `hosts` nodes of one SLURM job, asked for as `cfg` says."""

    spans_nodes = True

    def __init__(self, hosts: int, cfg: SlurmConfig) -> None:
        self.hosts = hosts
        self.cfg = cfg
        self._job: Any = None  # a SlurmJob, or the AllocationWorkers of our own job
        self._watcher: subprocess.Popen | None = None  # cancels a SlurmJob if we die

    def gpus_per_host(self) -> int:
        return self.cfg.gpus_per_node or 0

    def prepare(self) -> None:
        # A Monarch proc on a local socket (torchstore's may come before any mesh) could not
        # be answered from another node.
        configure_transport(self.cfg.driver_address)

    def start(self) -> tuple[HostMesh, list[str]]:
        python = self.cfg.python_exe or sys.executable
        if in_allocation():
            self._job = AllocationWorkers(self.hosts, self.cfg.port, python)
            return self._job.hosts, self._job.nodes
        self._job = slurm_job(self.hosts, self.cfg)
        self._job.apply()  # submitted: watched while it waits in the queue too
        self._watcher = cancel_with_driver(self._job)
        return self._job.state(cached_path=None).hosts, host_names(self.hosts)

    def select(self, mesh: HostMesh, hosts: Sequence[int]) -> HostMesh:
        return host_slice(mesh, hosts)

    async def rendezvous(self, hosts: HostMesh) -> tuple[str, int]:
        return await probe_rendezvous(hosts)

    async def lost(self, host: int) -> str | None:
        # Only the workers of our own job are probed: they listen at known addresses.
        if not isinstance(self._job, AllocationWorkers):
            return None
        node, port = self._job.addresses[host]
        why = await asyncio.to_thread(unreachable_twice, node, port)
        if why is None:
            return None
        return f"node {node} lost: its Monarch worker at {node}:{port} {why}"

    async def stop(self) -> None:
        try:
            if self._job is not None:
                self._job.kill()
                self._job = None
        finally:
            if self._watcher is not None:
                self._watcher.stdin.close()  # it cancels the job (again) and exits
                await asyncio.to_thread(self._watcher.wait, STOP_WATCHER_TIMEOUT_S)
                self._watcher = None


def slurm_job(hosts: int, cfg: SlurmConfig) -> Any:
    """A `monarch.job.SlurmJob` of `hosts` nodes as `cfg` asks, not yet submitted."""
    from monarch.job import SlurmJob  # here: loaded only by a run that uses it

    job = SlurmJob(
        {"hosts": hosts},
        python_exe=cfg.python_exe or sys.executable,
        slurm_args=cfg.extra_args,
        monarch_port=cfg.port,
        log_dir=cfg.log_dir,
        exclusive=cfg.exclusive,
        job_name=cfg.job_name,
        time_limit=cfg.time,
        partition=cfg.partition,
        gpus_per_node=cfg.gpus_per_node,
        cpus_per_task=cfg.cpus_per_task,
        mem=cfg.mem,
        account=cfg.account,
        qos=cfg.qos,
        job_start_timeout=cfg.job_start_timeout,
    )
    return patch_slurm_job(job, cfg.driver_address)


def unreachable_twice(host: str, port: int) -> str | None:
    """Why nothing accepted a connection at host:port in two tries HOST_PROBE_PAUSE_S apart
    (None: one was accepted): one refused or dropped connection does not lose a node."""
    if _unreachable(host, port) is None:
        return None
    time.sleep(HOST_PROBE_PAUSE_S)
    why = _unreachable(host, port)
    return None if why is None else f"{why}, twice {HOST_PROBE_PAUSE_S:g}s apart"


def _unreachable(host: str, port: int) -> str | None:
    """Why nothing accepts a connection at host:port (None: something does)."""
    try:
        socket.create_connection((host, port), timeout=HOST_PROBE_TIMEOUT_S).close()
    except TimeoutError:
        return f"did not answer in {HOST_PROBE_TIMEOUT_S:.0f}s"
    except OSError as e:
        return f"is unreachable ({e.strerror or e})"
    return None
