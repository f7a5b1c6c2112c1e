"""The slurm launcher and `forge submit` against a real SLURM cluster (`.ci/slurm.sh` starts
one on this machine): actors in a job the driver asked for (interactive), and whole tiny GRPO
runs submitted as batch jobs, finished, cancelled and resubmitted.

Tests that need SLURM are skipped where no SLURM node is idle, so machines without it still pass.
They all live in this file so that they run one after another (`--dist loadfile`): each job
takes the whole node (`--exclusive`).
"""

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import cloudpickle
import psutil
import pytest
from helper_actors import Echo
from helper_runs import ROOT, metrics, trained
from helper_slurm import (
    TINY,
    active_jobs,
    free_port,
    job_processes,
    no_slurm_reason,
    submit_grpo,
    submitted,
    tail,
    wait_job_done,
    wait_until,
)
from monarch.actor import endpoint

from forge.actors.trainer.checkpoint_folder import latest_step
from forge.controller import ProvisionerConfig, SlurmConfig, init_provisioner, shutdown
from forge.serve.attach import attach

PARTITION = "debug"


_SKIP = no_slurm_reason(PARTITION)
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


# --- forge submit: the run as one batch job ---------------------------------------------------


def _in_a_step(pid: int) -> bool:
    try:
        return any(p.name() == "slurmstepd" for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return True  # ended meanwhile: nothing left outside the job


def _node() -> str:
    out = subprocess.run(["sinfo", "-h", "-p", PARTITION, "-o", "%n"], capture_output=True)
    return out.stdout.decode().split()[0]


def _steps_logged(run_dir: Path) -> int:
    log = run_dir / "metrics.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


@needs_slurm
def test_a_run_warned_of_its_time_limit_requeues_finishes_in_the_same_job_then_says_finished(
    tmp_path,
):
    """A submitted run, attached to first, gets SLURM's warning of its time limit (SIGUSR1 to
    the batch step, as `--signal=B:USR1@warning_s` has SLURM send it): it ends as after
    Ctrl-C, with a final checkpoint, and requeues its job, which resumes from that checkpoint
    to the last step, with its log in the run folder, the export and the final checkpoint,
    every proc mesh on the job's node; submitted once more, it says it is finished and its
    job ends, exit 0."""
    run_dir, port, steps = tmp_path / "run", free_port(), 6
    args = (f"steps={steps}", "trainer.checkpoint.interval=0")  # only the warning's checkpoint
    job, log = submitted(submit_grpo(run_dir, port, *args), run_dir)
    try:
        assert log == run_dir / f"slurm-{job}.out"
        running = lambda: job in active_jobs() or pytest.fail(f"job ended\n{tail(log)}")  # noqa: E731
        wait_until(lambda: running() and _steps_logged(run_dir) >= 3, "three steps", log)
        # The driver, its workers and what they started: all in the job's steps, which SLURM
        # tracks (here by process tree, proctrack/linuxproc) and signals on scancel.
        procs = job_processes(job)
        assert procs and all(_in_a_step(pid) for pid in procs), procs
        # Its owner attaches to the job's driver (this machine is the partition's node).
        assert attach(run_dir).status()["state"] == "running"
        # What SLURM does `warning_s` before the time limit; the tiny run is over long before
        # a time limit SLURM can set (minutes, signalled up to a minute early) would come.
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
        wait_job_done(job, log)  # the same job: requeued, not submitted again
    finally:
        subprocess.run(["scancel", job])
    text = log.read_text()
    assert "forge: SIGUSR1: ending the run as after Ctrl-C" in text, tail(log)
    assert f"forge submit: job {job} requeued (1 of at most 3)" in text, tail(log)
    resumed_at = int(re.search(r"resuming at step (\d+)", text).group(1))
    assert 3 <= resumed_at < steps
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, steps + 1))
    ids = [e for r in trained(run_dir) for e in r["episodes"]]
    assert len(ids) == len(set(ids)) == steps * 8  # no episode trained twice, none lost
    assert (run_dir / "hf" / "model.safetensors").exists()
    assert latest_step(run_dir / "checkpoints") == steps
    assert f"metrics: {run_dir / 'metrics.jsonl'}" in text
    # Every proc mesh ran on the job's node, through the workers the driver started there.
    placement = json.loads((run_dir / "placement.json").read_text())
    assert {h for mesh in placement for h in mesh["hosts"]} == {_node()}

    finished, log = submitted(submit_grpo(run_dir, port, *args), run_dir)
    try:
        wait_job_done(finished, log, timeout=60)
    finally:
        subprocess.run(["scancel", finished])
    assert f"is finished: {steps} of {steps} steps taken" in log.read_text()
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, steps + 1))


@needs_slurm
def test_dry_run_prints_the_batch_script_and_submits_nothing(tmp_path):
    run_dir, jobs = tmp_path / "run", active_jobs()
    out = submit_grpo(
        run_dir,
        22222,
        "--dry-run",
        "--account=acct",
        "--qos=q",
        "provisioner.slurm.extra_args=[--constraint=cpu]",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    script = out.stdout.splitlines()
    for line in (
        "#SBATCH --nodes=1",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        f"#SBATCH --chdir={ROOT}",
        f"#SBATCH --partition={PARTITION}",
        "#SBATCH --time=00:10:00",
        "#SBATCH --account=acct",
        "#SBATCH --qos=q",
        "#SBATCH --exclusive",
        "#SBATCH --constraint=cpu",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR1@180",
        "export FORGE_SLURM_ALLOCATION=1",
    ):
        assert line in script, (line, out.stdout)
    command = next(line for line in script if line.startswith("exec "))
    assert f"-m forge run apps/grpo/main.py --config {TINY} run_dir={run_dir}" in command
    assert any(line.startswith("trainer ") for line in script)  # the placement plan
    assert not active_jobs() - jobs and not run_dir.exists()


@needs_slurm
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--partition=nosuch"], "forge: submit: sbatch refused the job: "),
        (
            ["provisioner.slurm.extra_args=[constraint=cpu]"],
            "forge: submit: provisioner.slurm.extra_args: 'constraint=cpu' is not an sbatch option",
        ),
        (
            ["--nodes=2", "provisioner.launcher=local"],
            "forge: config error: --nodes 2: provisioner.launcher=local runs on one node",
        ),
    ],
    ids=["unknown-partition", "extra-arg", "nodes-local"],
)
def test_a_bad_submission_is_one_line_and_submits_nothing(tmp_path, args, error):
    jobs = active_jobs()
    out = submit_grpo(tmp_path / "run", 22222, *args)
    assert out.returncode == 2 and out.stderr.startswith(error), out.stderr
    assert len(out.stderr.splitlines()) == 1 and not out.stdout, out.stderr
    assert not active_jobs() - jobs  # none added (an earlier one may have left)
