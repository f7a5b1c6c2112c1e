"""SmolLM2-135M learns to use a calculator tool, through `make agent`'s three stages cut short:
the demonstrations (apps/agent/demos.py), the warm start (configs/sft/tool_demos_smollm2_cpu
.yaml) and GRPO with the tool (configs/agent/smollm2_cpu.yaml).

A file of its own, so that a test worker runs it beside the other learning tests (`make test`
distributes files with --dist loadfile).
"""

import subprocess
import sys

import pytest
from helper_runs import ROOT, eval_metrics, evals, finish, forge_run, metrics

# Each run may take 20 minutes when the other test worker is busy too.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]
RUN_TIMEOUT_S = 1500
AGENT = "configs/agent/smollm2_cpu.yaml"
GRPO_STEPS = 4


def test_grpo_with_a_calculator_learns_three_digit_products_on_smollm2(tmp_path):
    """Three-digit products, 32 held-out rows, greedy. Measured: the base model without the
    tool scores 0, and with it too (it never writes a well-formed call); the warm
    start (6 SFT steps on 200 demonstrated episodes) answers in its head and scores 0 as well,
    though sampled at temperature 1 it calls the tool in some episodes (0.375 calls an episode
    in step 1's rollouts). GRPO then rewards the episodes that call and copy the result:
    held-out reward 0 -> 0.94 after 4 steps -> 1.0 after 8, every eval episode calling the
    calculator with a well-formed call; rollout reward 0.03, 0.06, 0.13, 0.19 in steps 1-4.
    The test asks for 0.5 after 4 steps, over the no-tool baseline of 0, with the eval's
    episodes calling the tool, all calls well formed."""
    demos = tmp_path / "demos.jsonl"
    command = [sys.executable, "apps/agent/demos.py", "--config", AGENT, "--out", str(demos)]
    subprocess.run([*command, "--rows", "200", "data.seed=1"], cwd=ROOT, check=True, timeout=300)
    sft = tmp_path / "sft"
    sft_config = "configs/sft/tool_demos_smollm2_cpu.yaml"
    finish(forge_run("sft", sft_config, sft, f"data.path={demos}"), sft, RUN_TIMEOUT_S)

    run_dir = tmp_path / "agent"
    overrides = (
        f"trainer.model={sft / 'hf'}",
        f"steps={GRPO_STEPS}",
        f"eval.interval={GRPO_STEPS}",
        "trainer.checkpoint.enabled=false",
        "export_hf=false",
    )
    finish(forge_run("grpo", AGENT, run_dir, *overrides), run_dir, RUN_TIMEOUT_S)
    rewards = [r["reward"] for r in evals(run_dir, "reward")]
    steps = metrics(run_dir)
    calls = [m["env/tool_calls"] for m in steps if "env/tool_calls" in m]
    print(f"held-out greedy reward {rewards}, tool calls per rollout episode {calls}")
    assert rewards[0] < 0.25 and rewards[-1] >= 0.5
    last_eval = eval_metrics(run_dir)[-1]
    assert last_eval["eval/env/tool_calls"] >= 0.9
    assert last_eval["eval/env/well_formed_fraction"] == 1.0
    assert all(m["train/mismatch_kl"] < 1e-3 for m in steps)
