"""`forge submit`: a whole run as one SLURM batch job, its driver inside the allocation.

Two halves, one per side of `sbatch`:
- outside, `batch_script` and `submit`: a batch script of a few `#SBATCH` lines and one
  command, the same `forge run` command a user would type, so the run folder's rules hold
  (submitting the same command again resumes the run; a finished run exits 0);
- inside, `AllocationWorkers`: with the `slurm` launcher, the driver (the batch step) starts one
  Monarch worker per node of its own job with `srun` and attaches to them, instead of asking
  SLURM for another job as it does when run from a login node.

Why a script of our own rather than Monarch 0.7's batch mode, `SlurmJob.apply(client_script=)`:
Monarch writes its script and submits it in one private step, so `--dry-run` could not show
it; it hands the job to the driver through `.monarch/job_state.pkl` in the submitting
directory, which a second submission from there overwrites before the first job starts (that
job then attaches with the other's worker identities); its in-allocation runner is a private
module. Here the workers start through public Monarch API (`run_worker_loop_forever`,
`attach_to_workers`) and `scancel` stops every process: the driver is the job's batch step,
and the workers with every process they spawn are a step of the same job.
"""

import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

from monarch.actor import HostMesh, attach_to_workers

from forge.controller.slurm.config import SlurmConfig
from forge.observability.console import say

# Set by the batch script: the driver's `slurm` launcher uses the job it runs in.
ALLOCATION_ENV = "FORGE_SLURM_ALLOCATION"
# The driver's exit status when a node of its run was lost (EX_TEMPFAIL: try again later).
HOST_LOST_STATUS = 75
# How long a stopped worker step may take to end before it is killed.
STOP_TIMEOUT_S = 30

# One Monarch worker, listening at the name SLURM knows its node by: the driver dials exactly
# that name, so both sides agree on the worker's address.
_WORKER = (
    "import os; from monarch.actor import run_worker_loop_forever; "
    "run_worker_loop_forever(address=f\"tcp://{os.environ['SLURMD_NODENAME']}:%d\", "
    "ca='trust_all_connections')"
)


class SubmitError(RuntimeError):
    """sbatch refused the job, or the options make no job; one line says why."""


def batch_script(
    command: Sequence[str], slurm: SlurmConfig, *, nodes: int, log: Path, workdir: Path
) -> str:
    """The sbatch script that runs `command` (the driver) on the first of `nodes` nodes.

    Raises:
        SubmitError: an `extra_args` entry is not an sbatch option.
    """
    lines = ["#!/bin/bash", *_directives(slurm, nodes=nodes, log=log, workdir=workdir)]
    lines += [
        "# The driver runs here; with the slurm launcher it starts its workers on the job's",
        "# nodes (srun), so scancel stops them all.",
        f"export {ALLOCATION_ENV}=1",
        f"exec {shlex.join(command)}",
    ]
    return "\n".join(lines) + "\n"


def _directives(slurm: SlurmConfig, *, nodes: int, log: Path, workdir: Path) -> list[str]:
    options = {
        "job-name": slurm.job_name,
        "nodes": nodes,
        "ntasks-per-node": 1,
        "chdir": workdir,
        "output": log,
        "partition": slurm.partition,
        "time": slurm.time,
        "account": slurm.account,
        "qos": slurm.qos,
        "gpus-per-node": slurm.gpus_per_node,
        "cpus-per-task": slurm.cpus_per_task,
        "mem": slurm.mem,
    }
    lines = [f"#SBATCH --{k}={v}" for k, v in options.items() if v is not None]
    # Requeued after a lost node (by the driver, or by SLURM when it was the driver's), and
    # each attempt's output kept in the one log.
    lines += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
    if slurm.warning_s is not None:
        # To the batch step alone (B:), which `exec`s the driver.
        lines.append(f"#SBATCH --signal=B:USR1@{slurm.warning_s}")
    if slurm.exclusive:
        lines.append("#SBATCH --exclusive")
    for arg in slurm.extra_args:
        if not arg.startswith("-"):
            raise SubmitError(f"provisioner.slurm.extra_args: {arg!r} is not an sbatch option")
        lines.append(f"#SBATCH {arg}")
    return lines


def submit(script: str) -> str:
    """Submits `script` with sbatch; returns the job id.

    Raises:
        SubmitError: sbatch is missing or refused the job (its first line of complaint).
    """
    try:
        out = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True)
    except FileNotFoundError:
        raise SubmitError("sbatch not found: run forge submit where SLURM is installed") from None
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[0]
        raise SubmitError(f"sbatch refused the job: {why}")
    return out.stdout.strip().split(";")[0]  # "id" or "id;cluster"


def requeue(limit: int) -> None:
    """Puts the SLURM job this driver runs in (`forge submit`) back in the queue, where it
    resumes the run from its newest checkpoint, and says so; nothing outside such a job, or
    once the job was requeued `limit` times."""
    if not in_allocation():
        return
    job, count = os.environ["SLURM_JOB_ID"], int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if count >= limit:
        say(f"forge submit: job {job} not requeued: requeued {count} times already (max_requeues)")
        return
    say(
        f"forge submit: job {job} requeued ({count + 1} of at most {limit}): the run resumes "
        "from its newest checkpoint"
    )
    # SLURM ends this driver with the job's other processes; the run has closed already.
    subprocess.run(["scontrol", "requeue", job], check=False)


def in_allocation() -> bool:
    """Whether this process is a driver that `forge submit` started inside its SLURM job."""
    return os.environ.get(ALLOCATION_ENV) == "1" and "SLURM_JOB_ID" in os.environ


class AllocationWorkers:
    """Monarch workers on the nodes of the SLURM job this process runs in, one per node.

    Started with one `srun` step; `kill` ends the step (SLURM ends it anyway with the job).

    Attributes:
        nodes: the nodes' names, in host-mesh order.
        addresses: where each node's worker listens (name, port), in the same order.
        hosts: the host mesh over them.
    """

    def __init__(self, hosts: int, port: int, python: str) -> None:
        nodes = _job_nodes()
        if len(nodes) < hosts:
            raise SubmitError(
                f"SLURM job {os.environ['SLURM_JOB_ID']} has {len(nodes)} node(s), "
                f"provisioner.hosts={hosts}"
            )
        self.nodes = nodes[:hosts]
        self.addresses = [(node, port) for node in self.nodes]
        # --overlap: the batch step (this driver) keeps its share of the first node's CPUs.
        srun = ["srun", "--overlap", f"--nodelist={','.join(self.nodes)}", f"--ntasks={hosts}"]
        self._step = subprocess.Popen([*srun, "--ntasks-per-node=1", python, "-c", _WORKER % port])
        self.hosts: HostMesh = attach_to_workers(
            name="hosts",
            ca="trust_all_connections",
            workers=[f"tcp://{node}:{port}" for node, port in self.addresses],
        )

    def kill(self) -> None:
        """Ends the workers' step and every process in it."""
        if self._step.poll() is None:
            self._step.terminate()  # srun passes it to every task and ends the step
            try:
                self._step.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._step.kill()
                self._step.wait()


def _job_nodes() -> list[str]:
    nodelist = os.environ["SLURM_JOB_NODELIST"]  # compressed: n[01-04]
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return out.stdout.split()
