"""SmolLM2-135M learns, through `python -m forge run`, with the shipped CPU configs cut short:
SFT (answers in tags) and distillation (of that SFT model); GRPO is test_learning_grpo.py's.

One file, so that one test worker runs them one after another (`make test` distributes files
with --dist loadfile): the SFT run is the distillation test's teacher. Both run split, a core
each: with the other test worker busy, two-thread colocated processes oversubscribe the
cores (measured in CI: the SFT run took 684 s colocated, 458 s split).
"""

from pathlib import Path

import pytest
from helper_runs import evals, finish, forge_run, metrics

# Each run may take 20 minutes when the other test worker is busy too.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]
RUN_TIMEOUT_S = 1500

SFT_STEPS = 10
DISTILL_STEPS = 10


@pytest.fixture(scope="module")
def sft_smollm2(tmp_path_factory) -> Path:
    """The run folder of `make sft`'s config cut to 10 steps, with its exported model (`hf/`):
    the SFT learning test reads it, and the distillation learning test distils it."""
    run_dir = tmp_path_factory.mktemp("sft") / "learn"
    overrides = (
        "placement=split",
        f"steps={SFT_STEPS}",
        f"eval.interval={SFT_STEPS}",
        "trainer.checkpoint.enabled=false",
    )
    finish(
        forge_run("sft", "configs/sft/smollm2_cpu.yaml", run_dir, *overrides),
        run_dir,
        RUN_TIMEOUT_S,
    )
    return run_dir


def test_sft_lowers_held_out_loss_and_raises_held_out_score_on_smollm2(sft_smollm2):
    """`make sft`'s config, fewer steps. The score is the config's reward: reasoning-gym
    correctness + the answer format (`<answer>` tags), each up to 1.

    Measured on the 64 held-out rows: the base model's held-out loss 1.52 and reward 0.6875
    (correct 0.6875, format 0); after 10 steps loss 0.16 and reward 1.55 (correct 0.55, format
    1.0); after 12, loss 0.12 and reward 1.67 (correct 0.67). Correctness alone dips first (0.52
    at step 6), while the model moves from answering in prose to answering in the tags
    directly, then climbs back. The test asks the loss to halve and the reward to gain 0.5,
    about half the gain measured, and correctness to stay within 0.2 of the base's.
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
        "placement=split",
        f"steps={DISTILL_STEPS}",
        f"teacher.model={sft_smollm2 / 'hf'}",
        "trainer.checkpoint.enabled=false",
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
