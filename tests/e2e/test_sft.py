"""The SFT app end to end, through `python -m forge run`, on real processes and vLLM."""

import pytest
from helper_runs import evals, finish, forge_run, metrics

pytestmark = pytest.mark.integration


@pytest.mark.xdist_group("smollm2")  # one at a time; shares the SFT run with distillation
@pytest.mark.timeout(1500)
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


def test_sft_on_a_local_jsonl_file(tmp_path):
    """A local file as the data, with a held-out reasoning-gym task; the tiny model."""
    rows = "\n".join(
        f'{{"question": "Calculate {a} + {b}.", "answer": "{a + b}"}}'
        for a in range(10)
        for b in range(10)
    )
    (tmp_path / "sums.jsonl").write_text(rows + "\n")
    run_dir = tmp_path / "local"
    overrides = (
        "data.source=local",
        f"data.local={{path: {tmp_path / 'sums.jsonl'}, prompt_column: question}}",
        "eval.dataset={task: basic_arithmetic, size: 100}",
        "steps=4",
        "export_hf=false",
    )
    finish(forge_run("sft", "configs/sft/tiny_cpu.yaml", run_dir, *overrides), run_dir)
    losses = [m["train/loss"] for m in metrics(run_dir)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert len(evals(run_dir, "loss")) == 3  # steps 0, 3 and 4
