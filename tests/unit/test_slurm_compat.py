"""monarch 0.7's SlurmJob reading SLURM 22.05's squeue answers (no SLURM needed here)."""

import json
import subprocess

from forge.controller.slurm import compat as slurm_compat


def test_squeue_json_of_slurm_22_05_reads_like_23_02(monkeypatch):
    # SLURM 22.05 ignores --job under --json: the asked-for job is not the first one listed.
    jobs = [
        {"job_id": 1, "job_state": "COMPLETED", "job_resources": {"nodes": "n0"}},
        {
            "job_id": 7,
            "job_state": "RUNNING",
            "job_resources": {
                "nodes": "n[1-2]",
                "allocated_nodes": [{"nodename": "n1"}, {"nodename": "n2"}],
            },
        },
    ]
    answer = subprocess.CompletedProcess([], 0, stdout=json.dumps({"jobs": jobs}), stderr="")
    monkeypatch.setattr(slurm_compat.subprocess, "run", lambda *a, **k: answer)
    job = slurm_compat._squeue_job("7")
    assert job["job_state"] == ["RUNNING"]
    assert job["job_resources"]["nodes"]["allocation"] == [{"name": "n1"}, {"name": "n2"}]
    assert slurm_compat._squeue_job("8") is None
