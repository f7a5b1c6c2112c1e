"""The SFT app end to end, through `python -m forge run`, on real processes and vLLM."""

import pytest
from helper_runs import evals, finish, forge_run, metrics

pytestmark = pytest.mark.integration


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
