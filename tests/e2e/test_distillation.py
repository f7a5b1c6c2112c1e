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


STEPS = 10


@pytest.mark.xdist_group("smollm2")  # one at a time; shares the SFT run with the SFT test
@pytest.mark.timeout(2400)  # alone, it first trains its teacher (the SFT test's run)
def test_student_takes_up_the_sft_teachers_answers_on_smollm2(sft_smollm2, tmp_path):
    """`make distill`'s config, 10 steps: the teacher is the SFT test's exported model, which
    answers "<answer>7</answer>"; the student, SmolLM2-135M-Instruct, answers in prose. The
    teacher returns its top 20 tokens per position and the KL there is computed.

    Measured: reverse KL per token by step 0.95, 0.74, 0.52, 1.21, 0.87, 0.72, 0.34, 0.19, 0.12,
    0.08 (the bump is the switch from prose to the teacher's format); held-out greedy reward
    0.69 -> 1.51 (format 0 -> 1.0, correctness 0.69 -> 0.51). With the sampled-token estimator
    the same setup's KL had not halved by step 12 and correctness fell to 0.16. The
    test asks the KL of the last step, and the mean of the last two, to be below half the
    first's, the format to be taken up (>= 0.9) and the held-out reward to gain 0.5.
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
    assert kl[-1] < 0.5 * kl[0]
    assert sum(kl[-2:]) < 0.5 * sum(kl[:2])
    assert rewards[-1]["rewards"]["format"] >= 0.9
    assert rewards[-1]["reward"] > rewards[0]["reward"] + 0.5


def test_sync_mode_and_async_at_age_zero_train_on_the_same_data(tmp_path):
    runs = {mode: tmp_path / mode for mode in ("sync", "async")}
    # Both at once: start-up is mostly waiting, and the runs share nothing but the machine.
    overrides = ("steps=3", "buffer.max_policy_age=0", "export_hf=false")
    procs = {m: distill(TINY, d, f"mode={m}", *overrides) for m, d in runs.items()}
    try:
        for mode, run_dir in runs.items():
            finish(procs[mode], run_dir)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
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
