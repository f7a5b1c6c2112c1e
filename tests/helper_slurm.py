"""Jobs on the test SLURM cluster that `.ci/slurm.sh` starts: whether a partition is up, `forge
submit` of the tiny GRPO config, and waits on a job's state and processes (shared by
tests/integration/test_slurm.py, one node, and test_slurm_nodes.py, two)."""

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helper_runs import ROOT

TINY = "configs/grpo/tiny_cpu.yaml"


def no_slurm_reason(partition: str) -> str | None:
    """Why no job could run in `partition` now (None: an idle node is there)."""
    if shutil.which("sinfo") is None:
        return "no SLURM here: sinfo is not on PATH (run .ci/slurm.sh)"
    out = subprocess.run(
        ["sinfo", "-h", "-p", partition, "-t", "idle", "-o", "%n"], capture_output=True, text=True
    )
    if out.returncode != 0 or not out.stdout.strip():
        why = out.stderr.strip() or "its nodes are busy, down or absent"
        return f"no idle SLURM node in partition {partition!r}: {why}"
    return None


def active_jobs() -> set[str]:
    """Ids of jobs squeue still shows (pending, running or completing)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def job_processes(job_id: str, **env: str) -> set[int]:
    """Processes on this machine that run inside the SLURM job (and have `env` in their
    environment: a role's `env` in the config marks its processes)."""
    wanted = {"SLURM_JOB_ID": job_id, **env}
    found = set()
    for p in psutil.process_iter():
        try:
            environ = p.environ()
        except (psutil.Error, OSError):  # gone, a zombie, or not ours to read
            continue
        if all(environ.get(k) == v for k, v in wanted.items()):
            found.add(p.pid)
    return found


def free_port() -> int:
    # Not the default 22222: a second test run or a stale worker may hold that one.
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def submit_grpo(
    run_dir: Path, port: int, *args: str, partition: str = "debug"
) -> subprocess.CompletedProcess:
    """`forge submit` of the tiny GRPO config, its workers started on the job's nodes (the
    slurm launcher inside the job); checkpoints in the run folder. The same arguments make
    the same command: the resubmission of a run."""
    cmd = [sys.executable, "-m", "forge", "submit", "apps/grpo/main.py", "--config", TINY]
    cmd += ["--partition", partition, "--time", "00:10:00", f"run_dir={run_dir}"]
    cmd += ["provisioner.launcher=slurm", f"provisioner.slurm.port={port}"]
    cmd += ["reward.functions=[helper_rewards:vowel_fraction]"]
    cmd += [*args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def submitted(out: subprocess.CompletedProcess, run_dir: Path) -> tuple[str, Path]:
    """The job id and log path `forge submit` printed (and that it named the run folder)."""
    assert out.returncode == 0, out.stderr[-2000:]
    said = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert said["run folder"] == str(run_dir)
    return said["job"], Path(said["log"])


def job_state(job_id: str) -> tuple[str, str]:
    """The job's state and exit code as `scontrol` reports them (COMPLETED, 0:0)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    return fields.get("JobState", "GONE"), fields.get("ExitCode", "")


def wait_until(condition, what: str, log: Path, timeout: float = 300) -> None:
    """Polls `condition` until true; fails with the end of the job's log after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout}s\n{tail(log)}")
        time.sleep(0.5)


def wait_job_done(job_id: str, log: Path, timeout: float = 300) -> None:
    """Until the job has ended, left squeue, and none of its processes remain; it must have
    exited 0."""
    # COMPLETING: SLURM is still ending the job's processes; COMPLETED (or another end) follows.
    ended = lambda: job_state(job_id)[0] not in ("PENDING", "RUNNING", "COMPLETING")  # noqa: E731
    wait_until(ended, "job end", log, timeout)
    state, code = job_state(job_id)
    assert (state, code) == ("COMPLETED", "0:0"), f"{state} {code}\n{tail(log)}"
    wait_until(lambda: job_id not in active_jobs() and not job_processes(job_id), "gone", log, 60)


def tail(log: Path) -> str:
    """The end of a job's log, for a failure message."""
    return log.read_text()[-3000:] if log.exists() else f"(no log at {log})"
