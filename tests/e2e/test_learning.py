"""SmolLM2-135M learns, through `python -m forge run`, with the shipped CPU configs cut short:
GRPO (one-digit additions), SFT (answers in tags) and distillation (of that SFT model).

One file, so that one test worker runs them one after another (`make test` distributes files
with --dist loadfile): each holds both cores (colocated) or one each (split), and the SFT run
is the distillation test's teacher.
"""

from pathlib import Path

import pytest
from helper_runs import evals, finish, forge_run, metrics, trained

# Each run may take 20 minutes when the other test worker is busy too.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]
RUN_TIMEOUT_S = 1500

SFT_STEPS = 12
DISTILL_STEPS = 10


@pytest.fixture(scope="module")
def sft_smollm2(tmp_path_factory) -> Path:
    """The run folder of `make sft`'s config cut to 12 steps, with its exported model (`hf/`):
    the SFT learning test reads it, and the distillation learning test distils it."""
    run_dir = tmp_path_factory.mktemp("sft") / "learn"
    overrides = (
        f"steps={SFT_STEPS}",
        f"eval.interval={SFT_STEPS}",
        "trainer.checkpoint.folder=null",
    )
    finish(
        forge_run("sft", "configs/sft/smollm2_cpu.yaml", run_dir, *overrides),
        run_dir,
        RUN_TIMEOUT_S,
    )
    return run_dir


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_async_grpo_learns_one_digit_additions_on_smollm2(placement, tmp_path):
    """SmolLM2-135M, `make grpo`'s config (reasoning-gym score + 0.2 x format), fewer steps,
    with generator and trainer taking turns on both cores, and on a core each.

    Measured: the base model's held-out greedy reward on these 64 rows is 0.6875 (greedy on
    fixed rows: the same every run). Split runs scored 0.8125 after 4 async steps, 0.89 after 8
    (twice) and 0.875 after 12; a colocated run 0.78 after 8 (with the other test worker busy,
    its steps took 25-50 s, a split run's 20-30 s). The test trains 8 steps and asks for a gain
    of 0.05, three more right answers of 64 and about half the smallest gain measured; the
    format reward stays 0 this early, so the gain is right answers (reasoning-gym score).
    """
    run_dir = tmp_path / "learn"
    overrides = (
        f"placement={placement}",
        "steps=8",
        "trainer.optimizer.lr=2e-5",
        "trainer.checkpoint.folder=null",
        "export_hf=false",
        "eval.interval=8",
    )
    finish(
        forge_run("grpo", "configs/grpo/smollm2_cpu.yaml", run_dir, *overrides),
        run_dir,
        RUN_TIMEOUT_S,
    )
    steps = metrics(run_dir)
    rewards = [r["reward"] for r in evals(run_dir, "reward")]
    base, last = rewards[0], rewards[-1]
    print(f"held-out greedy reward: base {base:.3f}, after 8 steps {last:.3f}")
    assert last > base + 0.05
    assert all(m["train/mismatch_kl"] < 1e-3 for m in steps)
    for record in trained(run_dir):
        ages = [record["trainer_version"] - v for v in record["policy_versions"]]
        assert max(ages) <= 1, record


def test_sft_lowers_held_out_loss_and_raises_held_out_score_on_smollm2(sft_smollm2):
    """`make sft`'s config, fewer steps. The score is the config's reward: reasoning-gym
    correctness + the answer format (`<answer>` tags), each up to 1.

    Measured on the 64 held-out rows: the base model's held-out loss 1.52 and reward 0.6875
    (correct 0.6875, format 0); after 12 steps loss 0.12 (0.17 at step 6) and reward 1.67
    (correct 0.67, format 1.0). Correctness alone dips first (0.52 at step 6), while the model
    moves from answering in prose to answering in the tags directly, then climbs back. The test
    asks the loss to halve and the reward to gain 0.5, about half the gain measured, and
    correctness to stay within 0.2 of the base's.
    """
    run_dir = sft_smollm2
    losses = [r["loss"] for r in evals(run_dir, "loss")]
    rewards = evals(run_dir, "reward")
    print(f"held-out loss {losses}, held-out greedy reward {rewards}")
    assert losses[-1] < 0.5 * losses[0]
    assert rewards[-1]["reward"] > rewards[0]["reward"] + 0.5
    correct = [r["rewards"]["reasoning_gym"] for r in rewards]
    assert correct[-1] > correct[0] - 0.2
    assert max(m["train/padding_fraction"] for m in metrics(run_dir)) < 0.1


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
        f"steps={DISTILL_STEPS}",
        f"teacher.model={sft_smollm2 / 'hf'}",
        "trainer.checkpoint.folder=null",
        "export_hf=false",
        f"eval.interval={DISTILL_STEPS}",
    )
    config = "configs/distillation/smollm2_cpu.yaml"
    finish(forge_run("distillation", config, run_dir, *overrides), run_dir, RUN_TIMEOUT_S)
    kl = [m["train/reverse_kl"] for m in metrics(run_dir)]
    rewards = evals(run_dir, "reward")
    print(f"reverse KL per step {kl}, held-out greedy reward {rewards}")
    assert kl[-1] < 0.5 * kl[0]
    assert sum(kl[-2:]) < 0.5 * sum(kl[:2])
    assert rewards[-1]["rewards"]["format"] >= 0.9
    assert rewards[-1]["reward"] > rewards[0]["reward"] + 0.5


def test_grpo_on_a_batch_of_64_runs_in_bounded_memory(tmp_path):
    """`make grpo`'s config with 8 prompts x 8 samples a step (the batch a TRL user starts
    with), 5 steps: the trainer takes it 8 sequences at a time (`micro_batch_size`). One pass
    over the 64 sequences was killed by the OOM killer at 13.9 GB before micro-batches.

    Measured: peaks of 3.5, 5.1, 5.2, 5.2, 5.2 GB (from step 2 on, the previous weights are
    kept for the exact mismatch KL: 0.54 GB). TRL's GRPOTrainer peaks at 6.3 GB on this workload.
    """
    run_dir = tmp_path / "batch64"
    overrides = (
        "placement=colocated",  # what auto picks here, without its calibration's minute
        "steps=5",
        "buffer.batch_size=64",
        "trainer.checkpoint.folder=null",
        "export_hf=false",
        "eval.interval=0",
    )
    finish(
        forge_run("grpo", "configs/grpo/smollm2_cpu.yaml", run_dir, *overrides),
        run_dir,
        RUN_TIMEOUT_S,
    )
    steps = metrics(run_dir)
    peaks = [m["train/peak_rss_gb"] for m in steps]
    print(f"trainer peak RSS per step (GB): {peaks}")
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
    assert all(len(r["episodes"]) == 64 for r in trained(run_dir))
    assert max(peaks) < 6.0
