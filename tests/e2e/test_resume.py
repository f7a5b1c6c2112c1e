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

from forge.actors.trainer.checkpointing import complete_steps, step_folder
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
    runs = {name: tmp_path / name for name in ("uninterrupted", "sync", "async")}
    mode = {"uninterrupted": "sync", "sync": "sync", "async": "async"}
    procs = {name: grpo(run_dir, f"mode={mode[name]}") for name, run_dir in runs.items()}
    try:
        kill_groups_after_a_checkpoint({runs[n]: procs[n] for n in ("sync", "async")})
        for name in ("sync", "async"):
            procs[name] = grpo(runs[name], f"mode={mode[name]}")  # the same command again
        for name, run_dir in runs.items():
            finish(procs[name], run_dir)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    for name in ("sync", "async"):
        resumed_at = int(re.search(r"resuming at step (\d+)", console(runs[name])).group(1))
        assert 2 <= resumed_at < STEPS
        steps = [m["step"] for m in metrics(runs[name])]
        assert steps == list(range(1, STEPS + 1))  # every step once, none lost
        records = trained(runs[name])
        assert [r["step"] for r in records] == steps
        ids = [e for r in records for e in r["episodes"]]
        assert len(ids) == len(set(ids)) == STEPS * 8  # no episode trained twice
    # The same weights and data at every step: the gradient norm (O(1)) to float32 precision.
    # Not the loss: a token-mean of advantage-weighted ratios whose advantages sum to zero in
    # each group, it is rounding around 0 (~1e-7) whose digits follow the summation order.
    resumed, reference = (
        [m["train/grad_norm"] for m in metrics(runs[n])] for n in ("sync", "uninterrupted")
    )
    assert resumed == pytest.approx(reference, rel=1e-5)
    assert [r["episodes"] for r in trained(runs["sync"])] == [
        r["episodes"] for r in trained(runs["uninterrupted"])
    ]

    # Each checkpoint is written after its step's row, so no kill can leave one of a step the
    # metrics do not show (a resumed run would then lack that step's row). A file's mtime is
    # the kernel's coarse clock, up to a tick behind time.time().
    written = {m["step"]: m["time"] for m in metrics(runs["uninterrupted"])}
    checkpoints = runs["uninterrupted"] / "checkpoints"
    for step in complete_steps(checkpoints):
        saved = (step_folder(checkpoints, step) / DRIVER_STATE).stat().st_mtime
        assert saved >= written[step] - 0.01, step

    # The killed runs' records hold each step once, and their training replays exactly: the
    # async run's whole, the sync run's last step (from its checkpoint, one rank).
    assert BatchRecord(runs["async"]).steps() == list(range(1, STEPS + 1))
    replayed = forge_replay(runs["async"], "--all")
    assert replayed.returncode == 0
    assert f"after step {STEPS}: the same parameters as the final checkpoint" in replayed.stdout
    last = forge_replay(runs["sync"], "--step", str(STEPS))
    assert last.returncode == 0 and f"step {STEPS}: replayed bit-exactly" in last.stdout

    # The finished run, asked again: one line, exit 0, nothing trained or started.
    again = grpo(runs["async"], "mode=async")
    assert again.wait(timeout=120) == 0
    assert f"is finished: {STEPS} of {STEPS} steps taken" in console(runs["async"])
    assert [m["step"] for m in metrics(runs["async"])] == list(range(1, STEPS + 1))


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
