"""Reward functions: answer extraction, reasoning-gym scoring, math-verify, robustness, and a
checker that raises counted as a failure."""

import logging
import threading

import pytest
import reasoning_gym

from forge.data.reward_runner import RewardRunner
from forge.data.rewards import (
    REWARD_FUNCTIONS,
    check_columns,
    extract_answer,
    extract_boxed,
    extract_last_number,
    extract_tagged,
    format_reward,
    math_verify_reward,
    reads_columns,
    reasoning_gym_reward,
    resolve_reward,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>7</answer>", "7"),
        ("think... <answer> 3 </answer> then <answer>8</answer>", "8"),
        ("<answer><answer>1</answer>", "1"),
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{4} but then \\boxed{5", "4"),  # the last box was cut off
        ("<answer>9</answer> and \\boxed{2}", "9"),  # tags win over boxes
        ("\\boxed{2} is 2, not 3", "2"),  # boxes win over bare numbers
        ("5 + 9 = 14.", "14"),
        ("it costs 1,234.50 dollars", "1234.50"),
        ("1,2,3", "3"),
        ("x = -7", "-7"),
        ("<answer>7", "7"),  # an unclosed tag falls back to the last number
        ("no digits here", None),
        ("", None),
        ("}{<answer></\\boxed{", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extractors_alone():
    assert extract_tagged("<think>a</think><answer>b</answer>", "think") == "a"
    assert extract_tagged("<answer></answer>") == ""
    assert extract_boxed("\\boxed{{1}+{2}}") == "{1}+{2}"
    assert extract_boxed("\\boxed{" * 20_000) is None  # linear time: returns at once
    assert extract_last_number("3.") == "3"


def rg_row(task: str = "basic_arithmetic", **config) -> dict:
    entry = reasoning_gym.create_dataset(task, size=1, seed=5, **config)[0]
    return {"answer": entry["answer"], "task": task, "columns": {"metadata": entry["metadata"]}}


def test_reasoning_gym_scores_right_and_wrong_answers():
    row = rg_row(min_terms=2, max_terms=2, max_digits=1, operators=["+"])
    right = row["answer"]
    wrong = str(int(right) + 1)
    assert reasoning_gym_reward(row, f"I add them. <answer>{right}</answer>") == 1.0
    assert reasoning_gym_reward(row, f"<answer>{wrong}</answer>") == 0.0
    assert reasoning_gym_reward(row, f"the answer is {right}") == 1.0  # last-number fallback
    assert reasoning_gym_reward(row, "I do not know") == 0.0


def test_reasoning_gym_uses_the_tasks_own_checker():
    row = rg_row("chain_sum", max_terms=2, max_digits=1)
    assert reasoning_gym_reward(row, f"<answer>{row['answer']}</answer>") == 1.0
    # The row's metadata names the checker even when "task" is absent.
    del row["task"]
    assert reasoning_gym_reward(row, f"<answer>{row['answer']}</answer>") == 1.0


def test_a_checker_that_raises_is_not_turned_into_a_wrong_answer():
    # prime_factorization's checker parses "a × b" and raises on an ASCII "x": that is the
    # checker's failure to score, which the caller must count, not a silent 0.
    row = rg_row("prime_factorization")
    assert reasoning_gym_reward(row, f"<answer>{row['answer']}</answer>") == 1.0
    with pytest.raises(ValueError, match="invalid literal for int"):
        reasoning_gym_reward(row, "<answer>3 x 3 x 71</answer>")


async def test_a_raising_checker_is_counted_in_failed_and_stats_and_logged_once(caplog):
    row = rg_row("prime_factorization")
    texts = [f"<answer>{a}</answer>" for a in ("3 x 3 x 71", "7 x 91", row["answer"])]
    functions = {"reasoning_gym": reasoning_gym_reward, "format": format_reward}
    runner = RewardRunner(functions, weights={}, timeout_s=60.0)  # one worker process
    await runner.start()
    try:
        with caplog.at_level(logging.WARNING, logger="forge.data.reward_runner"):
            results = await runner.evaluate([row] * 3, texts)
    finally:
        await runner.close()
    assert [r.failed for r in results] == [["reasoning_gym"], ["reasoning_gym"], []]
    assert [r.reward for r in results] == [1.0, 1.0, 2.0]  # format 1 each, then the checker's
    assert runner.stats()["errors"] == {"reasoning_gym": 2}
    [logged] = [r.getMessage() for r in caplog.records]
    assert logged.startswith(
        "reward 'reasoning_gym' failed: ValueError: invalid literal for int() with base 10:"
    )


@pytest.mark.parametrize(
    ("reference", "text"),
    [
        ("1/2", "<answer>0.5</answer>"),
        ("0.5", "<answer>\\frac{1}{2}</answer>"),
        ("\\frac{1}{2}", "<answer>1/2</answer>"),
        ("1/2", "so the answer is $\\boxed{\\frac12}$"),
        ("42", "The final answer is 42"),
    ],
)
def test_math_verify_accepts_equivalent_forms(reference, text):
    assert math_verify_reward({"answer": reference}, text) == 1.0


def test_math_verify_rejects_wrong_and_junk():
    assert math_verify_reward({"answer": "1/2"}, "<answer>0.6</answer>") == 0.0
    assert math_verify_reward({"answer": 3}, "no idea") == 0.0


def test_math_verify_works_off_the_main_thread():
    # math-verify's signal-based timeouts raise off the main thread: ours turns them off there.
    scores = []
    worker = threading.Thread(
        target=lambda: scores.append(math_verify_reward({"answer": "1/2"}, "0.5"))
    )
    worker.start()
    worker.join()
    assert scores == [1.0]


def test_a_row_the_reward_cannot_use_raises():
    with pytest.raises(KeyError, match="answer"):
        reasoning_gym_reward({"task": "basic_arithmetic"}, "<answer>1</answer>")
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        math_verify_reward({"answer": "Paris"}, "<answer>Paris</answer>")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>4</answer>", 1.0),
        ("reasoning first\n<answer>4</answer>\n", 1.0),
        ("<answer>4</answer> and more talk", 0.0),
        ("<answer>4</answer><answer>5</answer>", 0.0),
        ("<answer> </answer>", 0.0),
        ("4", 0.0),
    ],
)
def test_format_reward(text, expected):
    assert format_reward({}, text) == expected


WEIRD = [
    "",
    "\x00\x01\x02",
    "9" * 5000,
    "x" * 100_000,
    "}{}{",
    "\\boxed{",
    "\\boxed{\\boxed{\\boxed{}}}",
    "<answer>1/0</answer>",
    "\\frac{1}{0}",
    "2^2^2^2^2^2^2^2",
    "<answer>" + "(" * 500 + "</answer>",
    "ñ∑∫√ 😀",
]


@pytest.mark.parametrize("text", WEIRD, ids=range(len(WEIRD)))
@pytest.mark.parametrize("name", sorted(REWARD_FUNCTIONS))
def test_weird_output_scores_without_raising(name, text):
    row = {"answer": "1/2", "task": "basic_arithmetic", "columns": {}}
    assert 0.0 <= REWARD_FUNCTIONS[name](row, text) <= 1.0


def test_declared_columns_the_data_lacks_are_named():
    @reads_columns("difficulty", "source")
    def harder_is_better(row, text):
        return float(row["columns"]["difficulty"])

    functions = {"math_verify": math_verify_reward, "mine": harder_is_better}
    check_columns(functions, "rows.jsonl", ("question", "answer", "difficulty", "source"))
    with pytest.raises(ValueError) as e:
        check_columns(functions, "rows.jsonl", ("question", "answer"))
    assert str(e.value) == (
        "mine reads column 'difficulty'; mine reads column 'source', which rows.jsonl lacks "
        "(columns: question, answer)"
    )
    # reasoning-gym's scorer needs a task's metadata: a file of plain rows has none.
    with pytest.raises(ValueError, match="^reasoning_gym reads column 'metadata'"):
        check_columns(REWARD_FUNCTIONS, "rows.jsonl", ("q", "a"))


def test_resolve_reward():
    assert resolve_reward("format") is format_reward
    assert resolve_reward("forge.data.rewards:math_verify_reward") is math_verify_reward
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot import reward function"):
        resolve_reward("forge.data.rewards:nope")
    with pytest.raises(ValueError, match="not callable"):
        resolve_reward("forge.data.rewards:MATH_VERIFY_TIMEOUT_S")
