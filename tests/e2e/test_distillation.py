"""The distillation app end to end, through `python -m forge run`, on real processes and vLLM.

Tiny models, seconds per step: sync == async at max_policy_age 0, a killed teacher replica.
SmolLM2: the student learns from `make sft`'s exported model, as `make distill` does.
"""

import pytest
from helper_runs import (
    complete_groups,
    evals,
    finish,
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


STEPS = 8


@pytest.mark.timeout(1500)  # alone, it first trains its teacher (the SFT test's run)
def test_student_takes_up_the_sft_teachers_answers_on_smollm2(sft_smollm2, tmp_path):
    """`make distill`'s config, 8 steps: the teacher is the SFT test's exported model, which
    answers "<answer>7</answer>"; the student, SmolLM2-135M-Instruct, answers in prose.

    Measured (the same numbers in three runs): reverse KL per token by step 1.20, 0.84, 0.55,
    1.05, 0.95, 0.47, 0.86, 0.52 (0.50, 0.78, 0.21, 0.86 in steps 9-12: it falls, noisily, and
    has not halved by step 12); held-out greedy reward 0.6875 -> 1.16 at step 8 (format 0 -> 1.0,
    correctness 0.69 -> 0.16: the student takes up the teacher's answer format first, its
    numbers not yet). The test asks the mean KL of the last three steps to be below 0.85 x the
    first three's (measured 0.72), the format to be taken up (>= 0.9) and the reward to gain 0.3.
    """
    run_dir = tmp_path / "learn"
    overrides = (
        f"steps={STEPS}",
        f"teacher.model={sft_smollm2 / 'hf'}",
        "trainer.checkpoint.folder=null",
        "export_hf=false",
        f"eval.interval={STEPS}",
    )
    finish(distill("configs/distillation/smollm2_cpu.yaml", run_dir, *overrides), run_dir)
    kl = [m["train/reverse_kl"] for m in metrics(run_dir)]
    rewards = evals(run_dir, "reward")
    print(f"reverse KL per step {kl}, held-out greedy reward {rewards}")
    assert sum(kl[-3:]) < 0.85 * sum(kl[:3])
    assert rewards[-1]["rewards"]["format"] >= 0.9
    assert rewards[-1]["reward"] > rewards[0]["reward"] + 0.3


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
