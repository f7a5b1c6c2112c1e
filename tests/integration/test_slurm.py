"""The slurm launcher against a real SLURM cluster (`.ci/slurm.sh` starts one on this machine).

Tests that need SLURM are skipped where no SLURM node is idle, so machines without it still pass.
"""

import asyncio
import os
import shutil
import socket
import subprocess
import sys

import cloudpickle
import psutil
import pytest
from helper_actors import Echo
from monarch.actor import endpoint

from forge.controller import ProvisionerConfig, SlurmConfig, init_provisioner, shutdown

PARTITION = "debug"


def _no_slurm_reason() -> str | None:
    if shutil.which("sinfo") is None:
        return "no SLURM here: sinfo is not on PATH (run .ci/slurm.sh)"
    out = subprocess.run(
        ["sinfo", "-h", "-p", PARTITION, "-t", "idle", "-o", "%n"], capture_output=True, text=True
    )
    if out.returncode != 0 or not out.stdout.strip():
        why = out.stderr.strip() or "its nodes are busy, down or absent"
        return f"no idle SLURM node in partition {PARTITION!r}: {why}"
    return None


_SKIP = _no_slurm_reason()
needs_slurm = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
pytestmark = pytest.mark.integration


class SlurmEcho(Echo):
    """Echo that also says which SLURM job its process belongs to."""

    @endpoint
    async def slurm_job(self) -> tuple[int, str | None]:
        return os.getpid(), os.environ.get("SLURM_JOB_ID")


# This module is not importable in the worker processes (tests/integration is not on their
# path): ship SlurmEcho by value; its base Echo is imported there by name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def active_jobs() -> set[str]:
    """Ids of jobs squeue still shows (pending, running or completing)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def job_processes(job_id: str) -> set[int]:
    """Processes on this machine that run inside the SLURM job."""
    found = set()
    for p in psutil.process_iter():
        try:
            if p.environ().get("SLURM_JOB_ID") == job_id:
                found.add(p.pid)
        except (psutil.Error, OSError):  # gone, a zombie, or not ours to read
            pass
    return found


def free_port() -> int:
    # Not the default 22222: a second test run or a stale worker may hold that one.
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture
def slurm_config(tmp_path) -> ProvisionerConfig:
    slurm = SlurmConfig(
        partition=PARTITION,
        time="00:10:00",
        job_name="forge-test",
        port=free_port(),
        log_dir=str(tmp_path),  # the job's logs, not in the repository
        job_start_timeout=120,
    )
    return ProvisionerConfig(launcher="slurm", hosts=1, slurm=slurm)


async def _gone(job_id: str, timeout: float = 60.0) -> None:
    """Waits until squeue no longer shows the job and none of its processes remain."""
    async with asyncio.timeout(timeout):
        while job_id in active_jobs() or job_processes(job_id):
            await asyncio.sleep(0.5)


@needs_slurm
async def test_actor_runs_inside_the_slurm_job_and_no_job_outlives_shutdown(slurm_config):
    jobs_before = active_jobs()
    init_provisioner(slurm_config)
    try:
        actor = await SlurmEcho.options(procs=1).as_actor()
        pid, job_id = await actor.slurm_job.call_one()
        assert job_id in active_jobs() - jobs_before, (job_id, jobs_before)
        assert pid != os.getpid()
        assert await actor.work.call_one(7) == (pid, 7)
    finally:
        await shutdown()
    await _gone(job_id)


@needs_slurm
async def test_two_replica_service_on_the_slurm_host(slurm_config):
    init_provisioner(slurm_config)
    try:
        service = await SlurmEcho.options(num_replicas=2).as_service()
        answers = await service.slurm_job.fanout()
        results = await asyncio.gather(*(service.work.route(i) for i in range(8)))
    finally:
        await shutdown()
    pids, job_ids = zip(*answers, strict=True)
    assert len(set(pids)) == 2 and len(set(job_ids)) == 1 and job_ids[0] is not None
    assert {pid for pid, _ in results} == set(pids)
    assert sorted(x for _, x in results) == list(range(8))
    await _gone(job_ids[0])
