"""Every app's tiny config resumes as shipped (no checkpoint key in its yaml): killed, the same
command, asked for one more step, resumes from the checkpoint and takes each step once;
finished, it says so. GRPO's tiny config is tests/e2e/test_resume.py's, which also checks that
a resumed run is exact; the agent's tiny config (GRPO's app with an environment service) is
tests/e2e/test_chaos.py's, whose run is ended twice and run again; a larger `steps=` continuing
a finished run is the same resume from the newest checkpoint (tests/unit/test_run_folder.py)."""

import os
import signal

import pytest
from helper_runs import console, finish_all, forge_run, kill_groups_after_a_checkpoint, metrics

pytestmark = pytest.mark.integration

STEPS = 6
# app -> its tiny config
CONFIGS = {
    "distillation": "configs/distillation/tiny_cpu.yaml",
    "sft": "configs/sft/tiny_cpu.yaml",
}


def test_every_tiny_config_resumes_continues_and_says_finished(tmp_path):
    runs = {app: tmp_path / app for app in CONFIGS}
    # A checkpoint every 2 steps, so that the kill lands after one; none is asked to enable them.
    shape = ("trainer.checkpoint.interval=2", "export_hf=false")

    def start(app: str, steps: int):
        return forge_run(app, CONFIGS[app], runs[app], f"steps={steps}", *shape)

    # Side by side: start-up is mostly waiting, and the runs share nothing but the machine.
    procs = {app: start(app, STEPS) for app in CONFIGS}
    try:
        kill_groups_after_a_checkpoint({runs[app]: procs[app] for app in CONFIGS})
        procs = {app: start(app, STEPS + 1) for app in CONFIGS}  # resumes, one step more
        finish_all(procs, runs)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    for app, run_dir in runs.items():
        assert "resuming at step" in console(run_dir), app
        assert [m["step"] for m in metrics(run_dir)] == list(range(1, STEPS + 2)), app

    for app, run_dir in runs.items():
        assert start(app, STEPS + 1).wait(timeout=120) == 0
        assert f"is finished: {STEPS + 1} of {STEPS + 1} steps taken" in console(run_dir), app
