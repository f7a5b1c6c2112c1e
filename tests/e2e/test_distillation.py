"""The distillation app end to end, through `python -m forge run`, on real processes and vLLM.

Tiny-model runs check the machinery (sync == async at max_policy_age 0, a killed teacher
replica); the SmolLM2 run checks that a pruned student learns from its teacher.
"""

import os
import signal

import pytest
from helper_runs import (
    complete_groups,
    evals,
    finish,
    forge_run,
    metrics,
    processes_with_env,
    trained,
    wait_for_steps,
)

pytestmark = pytest.mark.integration

TINY = "configs/distillation/tiny_cpu.yaml"


def distill(config: str, run_dir, *overrides: str):
    return forge_run("distillation", config, run_dir, *overrides)


def test_a_pruned_student_learns_from_its_teacher_on_smollm2(tmp_path):
    """`make distill`'s config, fewer steps.

    THRESHOLD
    """
    run_dir = tmp_path / "learn"
    overrides = (
        "steps=12",
        "trainer.checkpoint.folder=null",
        "export_hf=false",
        "eval.interval=12",
    )
    finish(distill("configs/distillation/smollm2_cpu.yaml", run_dir, *overrides), run_dir)
    kl = [m["train/reverse_kl"] for m in metrics(run_dir)]
    scores = [r["rewards"]["reasoning_gym"] for r in evals(run_dir, "reward")]
    print(f"reverse KL per step: {[round(k, 3) for k in kl]}; held-out greedy score {scores}")
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:3]) / 3
    assert scores[-1] > scores[0]


def test_sync_mode_and_async_at_age_zero_train_on_the_same_data(tmp_path):
    runs = {}
    for mode in ("sync", "async"):
        run_dir = tmp_path / mode
        overrides = (f"mode={mode}", "steps=3", "buffer.max_policy_age=0", "export_hf=false")
        finish(distill(TINY, run_dir, *overrides), run_dir)
        runs[mode] = run_dir
    sync, asynchronous = (trained(runs[m]) for m in ("sync", "async"))
    assert [s["episodes"] for s in sync] == [a["episodes"] for a in asynchronous]
    for key in ("train/loss", "train/reverse_kl", "train/grad_norm"):
        sync_values, async_values = ([m[key] for m in metrics(runs[mode])] for mode in runs)
        assert sync_values == pytest.approx(async_values, rel=1e-5, abs=1e-7), key
    assert min(m["train/grad_norm"] for m in metrics(runs["sync"])) > 1e-4


def test_a_killed_teacher_replica_loses_no_episode_and_scores_none_twice(tmp_path):
    run_dir = tmp_path / "kill"
    proc = distill(
        TINY,
        run_dir,
        "steps=30",
        "export_hf=false",
        "teacher_resources.num_replicas=2",
        "teacher_resources.env.FORGE_TEST_ROLE=teacher",
    )
    try:
        wait_for_steps(proc, run_dir, 3)
        teachers = processes_with_env(proc.pid, "FORGE_TEST_ROLE", "teacher")
        assert len(teachers) == 2, teachers
        os.kill(teachers[0], signal.SIGKILL)
        finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = metrics(run_dir)
    assert max(m.get("teacher/deaths", 0) for m in steps) >= 1
    assert max(m.get("teacher/recoveries", 0) for m in steps) >= 1
    assert not any(m.get("rollout/failed_groups") for m in steps)
    assert sum(len(s["episodes"]) for s in trained(run_dir)) == 30 * 8  # every step full
    complete_groups(run_dir, 4, steps)
