"""The distillation app end to end, through `python -m forge run`, on real processes and vLLM.

Tiny models, seconds per step: sync == async at max_policy_age 0 (and a step replays bit-exactly
from the batch record), a killed teacher replica.
The SmolLM2 learning test is in test_learning.py.
"""

import pytest
from helper_runs import (
    complete_groups,
    finish_all,
    forge_replay,
    forge_run,
    kill_one_mid_run,
    metrics,
    processes_with_env,
    trained,
)

pytestmark = pytest.mark.integration

TINY = "configs/distillation/tiny_cpu.yaml"


def distill(config: str, run_dir, *overrides: str):
    return forge_run("distillation", config, run_dir, *overrides)


def test_sync_mode_and_async_at_age_zero_train_on_the_same_data(tmp_path):
    runs = {mode: tmp_path / mode for mode in ("sync", "async")}
    # Both at once: start-up is mostly waiting, and the runs share nothing but the machine.
    overrides = ("steps=3", "buffer.max_policy_age=0", "export_hf=false")
    overrides += ("trainer.checkpoint.enabled=false",)  # the replay below starts from step 0
    procs = {m: distill(TINY, d, f"mode={m}", *overrides) for m, d in runs.items()}
    finish_all(procs, runs)
    sync, asynchronous = (trained(runs[m]) for m in ("sync", "async"))
    assert [s["episodes"] for s in sync] == [a["episodes"] for a in asynchronous]
    for key in ("train/loss", "train/reverse_kl", "train/grad_norm"):
        sync_values, async_values = ([m[key] for m in metrics(runs[mode])] for mode in runs)
        assert sync_values == pytest.approx(async_values, rel=1e-5, abs=1e-7), key
    assert min(m["train/grad_norm"] for m in metrics(runs["sync"])) > 1e-4
    # No checkpoints: the replay starts from the starting weights.
    replayed = forge_replay(runs["async"], "--step", "3")
    assert replayed.returncode == 0
    assert "from the run's starting weights, steps 1..3" in replayed.stdout
    assert "step 3: replayed bit-exactly" in replayed.stdout


def test_a_killed_teacher_replica_loses_no_episode_and_scores_none_twice(tmp_path):
    run_dir = tmp_path / "kill"
    proc = distill(
        TINY,
        run_dir,
        "steps=16",
        "export_hf=false",
        "teacher_resources.num_replicas=2",
        "teacher_resources.env.FORGE_TEST_ROLE=teacher",
    )
    kill_one_mid_run(
        proc, run_dir, lambda pid: processes_with_env(pid, "FORGE_TEST_ROLE", "teacher"), 2
    )
    steps = metrics(run_dir)
    assert max(m.get("teacher/deaths", 0) for m in steps) >= 1
    assert max(m.get("teacher/recoveries", 0) for m in steps) >= 1
    assert not any(m.get("rollout/failed_groups") for m in steps)
    assert sum(len(s["episodes"]) for s in trained(run_dir)) == 16 * 8  # every step full
    complete_groups(run_dir, 4, steps)
