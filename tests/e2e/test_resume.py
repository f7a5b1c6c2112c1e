"""A run is its folder: killed, it resumes exactly; finished, it is not run again; its dead
trainer is restarted. Tiny GRPO runs through `python -m forge run`, real processes killed."""

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from helper_cgroup import memory_cgroup
from helper_runs import (
    console,
    finish,
    forge_replay,
    forge_run,
    kill_groups_after_a_checkpoint,
    metrics,
    processes_with_env,
    trained,
    wait_for_steps,
)

from forge.actors.trainer.checkpoint_folder import complete_steps, step_folder
from forge.loop.record.batches import BatchRecord
from forge.loop.run_folder import DRIVER_STATE

pytestmark = pytest.mark.integration

TINY = "configs/grpo/tiny_cpu.yaml"
STEPS = 6


def grpo(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return forge_run(
        "grpo",
        TINY,
        run_dir,
        "reward.functions=[helper_rewards:vowel_fraction]",
        f"steps={STEPS}",
        "export_hf=false",
        "trainer.checkpoint.interval=2",
        *overrides,
    )


def test_a_killed_run_resumes_exactly_and_a_finished_one_is_not_run_again(tmp_path):
    """A sync run killed after a checkpoint and run again matches an uninterrupted one step for
    step. An async run killed and resumed, its whole record replayed, is the chaos test's
    (test_chaos.py kills its driver); other apps' resumes, test_every_config_resumes.py's."""
    runs = {name: tmp_path / name for name in ("uninterrupted", "killed")}
    procs = {name: grpo(run_dir, "mode=sync") for name, run_dir in runs.items()}
    try:
        kill_groups_after_a_checkpoint({runs["killed"]: procs["killed"]})
        procs["killed"] = grpo(runs["killed"], "mode=sync")  # the same command again
        for name, run_dir in runs.items():
            finish(procs[name], run_dir)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    resumed_at = int(re.search(r"resuming at step (\d+)", console(runs["killed"])).group(1))
    assert 2 <= resumed_at < STEPS
    steps = [m["step"] for m in metrics(runs["killed"])]
    assert steps == list(range(1, STEPS + 1))  # every step once, none lost
    records = trained(runs["killed"])
    assert [r["step"] for r in records] == steps
    ids = [e for r in records for e in r["episodes"]]
    assert len(ids) == len(set(ids)) == STEPS * 8  # no episode trained twice
    assert BatchRecord(runs["killed"]).steps() == steps
    # The same weights and data at every step: the gradient norm (O(1)) to float32 precision.
    # Not the loss: a token-mean of advantage-weighted ratios whose advantages sum to zero in
    # each group, it is rounding around 0 (~1e-7) whose digits follow the summation order.
    resumed, reference = (
        [m["train/grad_norm"] for m in metrics(runs[n])] for n in ("killed", "uninterrupted")
    )
    assert resumed == pytest.approx(reference, rel=1e-5)
    uninterrupted = trained(runs["uninterrupted"])
    assert [r["episodes"] for r in records] == [r["episodes"] for r in uninterrupted]

    # Each checkpoint is written after its step's row, so no kill can leave one of a step the
    # metrics do not show (a resumed run would then lack that step's row). A file's mtime is
    # the kernel's coarse clock, up to a tick behind time.time().
    written = {m["step"]: m["time"] for m in metrics(runs["uninterrupted"])}
    checkpoints = runs["uninterrupted"] / "checkpoints"
    for step in complete_steps(checkpoints):
        saved = (step_folder(checkpoints, step) / DRIVER_STATE).stat().st_mtime
        assert saved >= written[step] - 0.01, step

    # The resumed run's last step replays exactly from its checkpoint.
    last = forge_replay(runs["killed"], "--step", str(STEPS))
    assert last.returncode == 0 and f"step {STEPS}: replayed bit-exactly" in last.stdout

    # The finished run, asked again: one line, exit 0, nothing trained or started.
    again = grpo(runs["killed"], "mode=sync")
    assert again.wait(timeout=120) == 0
    assert f"is finished: {STEPS} of {STEPS} steps taken" in console(runs["killed"])
    assert [m["step"] for m in metrics(runs["killed"])] == steps


def test_a_trainer_the_oom_killer_ends_is_named_and_restarted(tmp_path):
    """After step 3 the trainer's process joins a cgroup whose memory limit its next pages
    exceed: the kernel's OOM killer ends it (a real limit, not a signal sent by the test).
    The console names the OOM killer, the rank and what the process held; the trainer is
    restarted from its checkpoint, and the run takes each step once. The run is long enough
    that the trainer still has steps to take (new pages to fault) however late the test
    sees step 3."""
    run_dir = tmp_path / "oom"
    steps = 3 * STEPS
    proc = grpo(run_dir, f"steps={steps}", "trainer_resources.env={FORGE_TEST_ROLE: trainer}")
    try:
        with memory_cgroup(1 << 20) as procs:
            wait_for_steps(proc, run_dir, 3)
            (trainer,) = processes_with_env(proc.pid, "FORGE_TEST_ROLE", "trainer")
            procs.write_text(str(trainer))
            finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    named = [x for x in console(run_dir).splitlines() if "the OOM killer ended" in x]
    assert len(named) == 1, console(run_dir)
    assert f"the OOM killer ended rank 0 (pid {trainer}), holding " in named[0]
    assert "restarted from the checkpoint of step" in named[0]
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, steps + 1))
