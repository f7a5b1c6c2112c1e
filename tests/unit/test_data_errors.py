"""Bad data and rewards, as a user meets them through `forge run`: one line naming the cause,
exit status 2, and nothing started (the run folder is not even opened)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
CONFIG = "configs/grpo/own_data_cpu.yaml"
FILE = "examples/own_data/additions.jsonl"
MINE = "math_verify, my_rewards:right_length"  # the config's functions (its weights name them)


def forge_run(
    run_dir: Path, *overrides: str, app: str = "grpo", config: str = CONFIG
) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'examples/own_data'}"}
    result = subprocess.run(
        [sys.executable, "-m", "forge", "run", f"apps/{app}/main.py", "--config", config,
         f"run_dir={run_dir}", *overrides],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    return result.returncode, (result.stdout + result.stderr).strip().splitlines()[-1]


def bad_rows(tmp_path: Path) -> str:
    rows = [{"question": "What is 1 + 2?", "answer": 3}, {"question": "What is 2 + 2?"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"data.path={path}"


CASES = {
    "missing file": (
        lambda tmp: "data.path=nowhere/rows.jsonl",
        "data: nowhere/rows.jsonl: no such file or folder",
    ),
    "missing column": (
        lambda tmp: "data.answer_column=sum",
        f"data: {FILE}: no column 'sum' (columns: question, answer, digits); set "
        "data.answer_column",
    ),
    "row without an answer": (
        bad_rows,
        "rows.jsonl line 2: column 'answer' is null; data.on_bad_row: skip skips them",
    ),
    "unknown reward module": (
        lambda tmp: f"reward.functions=[{MINE}, their_rewards:score]",
        "reward.functions: cannot import reward function 'their_rewards:score': No module named "
        "'their_rewards' (is the folder holding their_rewards on PYTHONPATH?)",
    ),
    "a column the data lacks": (
        lambda tmp: f"reward.functions=[{MINE}, reasoning_gym]",
        f"reward.functions: reasoning_gym reads column 'metadata', which local:{FILE} lacks "
        "(columns: question, answer, digits)",
    ),
    "an eval split a file lacks": (
        lambda tmp: "eval.split=test",
        f"eval: {FILE}: one file holds one split, 'train'; no split 'test'",
    ),
    "the old spelling": (
        lambda tmp: "dataset.task=chain_sum",
        "command line: dataset: renamed to data (one data section for every app: docs/data.md)",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_naming_it_before_anything_starts(tmp_path, case):
    override, expected = CASES[case]
    code, last_line = forge_run(tmp_path / "run", override(tmp_path))
    assert code == 2
    assert last_line.startswith("forge: config error: ") and last_line.endswith(expected)
    assert not (tmp_path / "run" / "config.yaml").exists()  # the run folder was not opened


def test_an_sft_target_column_the_data_lacks_is_one_line_before_anything_starts(tmp_path):
    data = f"data={{source: local, path: {FILE}, prompt_column: question}}"
    overrides = (data, "reward.functions=[math_verify]", "target.column=proof")
    code, last_line = forge_run(
        tmp_path / "run", *overrides, app="sft", config="configs/sft/tiny_cpu.yaml"
    )
    assert code == 2
    assert last_line == (
        f"forge: config error: target.column: local:{FILE}: no column 'proof' (columns: "
        "question, answer, digits); set target.column"
    )
    assert not (tmp_path / "run" / "config.yaml").exists()
