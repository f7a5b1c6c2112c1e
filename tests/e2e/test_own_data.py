"""Every app on a user's own data, with a config alone: the jsonl file the repository ships
(examples/own_data), math-verify against its answers, a reward module of the user's own on
PYTHONPATH, eval rows held out of the same file. Tiny models, real processes and vLLM."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from helper_runs import (
    ROOT,
    console,
    evals,
    finish,
    forge_run,
    jsonl,
    kill_groups_after_a_checkpoint,
    metrics,
    trained,
)

pytestmark = pytest.mark.integration

OWN_DATA = ROOT / "examples" / "own_data"
USER_REWARD = "my_rewards:right_length"
# The data section every app reads, the same for all three.
DATA = (
    f"data={{source: local, path: {OWN_DATA / 'additions.jsonl'}, prompt_column: question, "
    "answer_column: answer}"
)
TINY = (
    "generator.model=tiny-llama",
    "trainer.model=tiny-llama",
    "generator.max_model_len=512",
    "generator.max_num_seqs=32",
    "generator.kv_cache_mb=64",
    "generator.sampling.max_tokens=16",
    "export_hf=false",
)
STEPS = 6


@pytest.fixture(autouse=True)
def user_module_on_pythonpath(monkeypatch):
    """The user's reward module importable by name, as `PYTHONPATH=examples/own_data` makes it."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(OWN_DATA), os.environ["PYTHONPATH"]]))


def own_grpo(run_dir: Path) -> subprocess.Popen:
    """configs/grpo/own_data_cpu.yaml as shipped (its data, rewards and held-out eval), on the
    tiny model, in sync mode: a resumed run must redo the same rows."""
    return forge_run(
        "grpo",
        "configs/grpo/own_data_cpu.yaml",
        run_dir,
        *TINY,
        "placement=split",
        "mode=sync",
        f"steps={STEPS}",
        "group_size=4",
        "buffer.batch_size=8",
        "eval={interval: 3, size: 16, max_tokens: 8}",
        "trainer.checkpoint.interval=2",
    )


def test_grpo_on_a_jsonl_with_a_users_reward_holds_out_eval_rows_and_resumes_in_place(tmp_path):
    run_dir = tmp_path / "grpo"
    proc = own_grpo(run_dir)
    try:
        kill_groups_after_a_checkpoint({run_dir: proc})
        killed = trained(run_dir)
        proc = own_grpo(run_dir)  # the same command again
        finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()

    out = console(run_dir)
    assert "data local:examples/own_data/additions.jsonl, 584 rows" in out
    assert "eval 16 rows held out of local:" in out and "(never trained on)" in out
    resumed_at = int(re.search(r"resuming at step (\d+)", out).group(1))
    assert 2 <= resumed_at < len(killed)

    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for key in ("rollout/reward/math_verify", f"rollout/reward/{USER_REWARD}"):
        assert all(key in m for m in steps), key
    scored = evals(run_dir, "reward")
    assert [e["step"] for e in scored] == [0, 3, 6]
    assert all(set(e["rewards"]) == {"math_verify", USER_REWARD} for e in scored)

    records = trained(run_dir)
    rows = [r for record in records for r in record["rows"]]
    # Each step once, its group's rows: 2 prompts of 4 samples, no row trained twice.
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    prompts = [rows[i] for i in range(0, len(rows), 4)]
    assert len(set(prompts)) == len(prompts) == 2 * STEPS
    held_out = [r["index"] for r in jsonl(run_dir / "eval_rows.jsonl")]
    assert len(set(held_out)) == 16 and not set(held_out) & set(rows)
    # The steps redone after the checkpoint trained on the rows the killed run had reached.
    redone = [r for r in killed if r["step"] > resumed_at]
    assert redone and all(r["rows"] == records[r["step"] - 1]["rows"] for r in redone)


def test_sft_and_distillation_read_the_same_file_with_the_same_data_section(tmp_path):
    scored = ("reward.functions=[math_verify]", "eval.interval=2", "eval.max_tokens=8")
    sft_dir, distill_dir = tmp_path / "sft", tmp_path / "distill"
    procs = {
        sft_dir: forge_run(
            "sft", "configs/sft/tiny_cpu.yaml", sft_dir, DATA, *scored,
            "eval.fraction=0.05", "eval.size=8", "steps=4", "export_hf=false",
        ),
        distill_dir: forge_run(
            "distillation", "configs/distillation/tiny_cpu.yaml", distill_dir, DATA, *scored,
            "eval.size=8", "steps=2", "export_hf=false",
        ),
    }  # fmt: skip
    try:
        for run_dir, proc in procs.items():
            finish(proc, run_dir)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()

    # SFT holds out 5% of the file (30 rows), answers 8 of them, and learns the rest's answers.
    assert "eval 8 of the 30 rows held out of local:" in console(sft_dir)
    losses = [m["train/loss"] for m in metrics(sft_dir)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert [e["step"] for e in evals(sft_dir, "loss")] == [0, 2, 4]
    held_out = {r["index"] for r in jsonl(sft_dir / "eval_rows.jsonl")}
    assert len(held_out) == 8
    questions = {json.loads(line)["question"] for line in (OWN_DATA / "additions.jsonl").open()}
    assert {r["question"] for r in jsonl(sft_dir / "eval_rows.jsonl")} <= questions
    trained_rows = {r for record in trained(sft_dir) for r in record["rows"]}
    assert len(trained_rows) == 4 * 8 and not trained_rows & held_out

    assert "eval 8 rows held out of local:" in console(distill_dir)
    assert [m["step"] for m in metrics(distill_dir)] == [1, 2]
    assert {e["step"] for e in evals(distill_dir, "reward")} == {0, 2}
    distilled = {r for record in trained(distill_dir) for r in record["rows"]}
    assert distilled and not distilled & {
        r["index"] for r in jsonl(distill_dir / "eval_rows.jsonl")
    }
