"""Compatibility of monarch 0.7.0's `SlurmJob` with SLURM 22.05 (Debian 12) and loopback hosts.

Three upstream gaps, all in torchmonarch 0.7.0:
- it reads `squeue --json` in the SLURM 23.02+ layout, and SLURM 22.05 ignores `--job` when
  `--json` is given, so monarch would read whichever job is listed first;
- it makes the driver listen on its hostname's address, and panics when that name resolves only
  to loopback (Debian's 127.0.1.1 entry, containers);
- a driver outside the job cancels it only from `kill()`: one that ends without it (a Jupyter
  kernel shut down or killed) leaves the job running until its time limit.
"""

import ipaddress
import json
import logging
import socket
import subprocess
import sys
from typing import Any

from monarch.actor import ChannelTransport
from monarch.config import configure

logger = logging.getLogger(__name__)


def patch_slurm_job(job: Any, address: str | None = None) -> Any:
    """Applies both fixes to one `SlurmJob` (and, for the second, to this process)."""
    job._get_job_info_json = _squeue_job
    # Again, though the provisioner did it at its start: monarch's SlurmJob sets its own
    # transport, which panics on a hostname that resolves only to loopback.
    configure_transport(address)
    return job


# Reads until this driver's end of the pipe closes (the driver ended, however), then cancels.
_CANCEL_AT_EOF = (
    "import subprocess, sys; sys.stdin.buffer.read(); "
    "subprocess.run(['scancel', sys.argv[1]], capture_output=True)"
)


def cancel_with_driver(job: Any) -> subprocess.Popen:
    """Starts a watcher that cancels the submitted `SlurmJob`'s job once this process has
    ended, even by SIGKILL: it waits for the end of a pipe whose write end this process holds
    (not inherited across exec, so the processes it starts do not hold it). Closing the
    watcher's stdin cancels the job at once."""
    if job._slurm_job_id is None:
        raise RuntimeError("the SLURM job has no id yet: submit it (apply) first")
    return subprocess.Popen(
        [sys.executable, "-c", _CANCEL_AT_EOF, job._slurm_job_id],
        stdin=subprocess.PIPE,
        start_new_session=True,  # outside the driver's process group, which Jupyter kills
    )


def configure_transport(address: str | None = None) -> None:
    """Makes this process listen where SLURM nodes can reach it: on `address` if given, else
    on its hostname's address, as monarch's SlurmJob does, or on localhost when that name
    resolves only to loopback."""
    if address is not None:
        configure(default_transport=f"tcp://{address}:0")
        return
    if _hostname_routable():
        configure(default_transport=ChannelTransport.TcpWithHostname)
        return
    # No other machine could reach this one by that name anyway: the nodes must be this one.
    logger.warning("%s resolves only to loopback: listening on localhost", socket.gethostname())
    configure(default_transport=ChannelTransport.TcpWithLocalhost)


def _hostname_routable() -> bool:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return False
    addrs = (ipaddress.ip_address(info[4][0]) for info in infos)
    return any(not (a.is_loopback or a.is_link_local) for a in addrs)


def _squeue_job(job_id: str) -> dict[str, Any] | None:
    """One job from `squeue --json`, in the shape monarch 0.7 reads (SLURM 23.02+).

    SLURM 22.05 (Debian 12) lists every job whatever `--job` says, so monarch would read the
    first job listed, often an old one; it also gives `job_state` as a string and the nodes
    under `job_resources.allocated_nodes`.
    """
    out = subprocess.run(["squeue", "--job", job_id, "--json"], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        return None  # squeue no longer knows the id: the job ended a while ago
    jobs = json.loads(out.stdout).get("jobs", [])
    job = next((j for j in jobs if str(j.get("job_id")) == job_id), None)
    return _as_squeue_23(job) if job else None


def _as_squeue_23(job: dict[str, Any]) -> dict[str, Any]:
    if isinstance(job.get("job_state"), str):
        job["job_state"] = [job["job_state"]]
    res = job.get("job_resources") or {}
    if isinstance(res.get("nodes"), str):
        nodes = [{"name": n["nodename"]} for n in res.get("allocated_nodes", [])]
        job["job_resources"] = {**res, "nodes": {"allocation": nodes}}
    return job
