"""The tasks forge ships as environments, stepped by hand: a question with a calculator, the
same question single-turn, and guess-a-number."""

import json

import pytest

from forge.envs.tasks import GuessNumber, ToolTask, calculator

ROW = {
    "index": 3,
    "question": "What is 4821 * 7395?",
    "answer": "35651295",
    "prompt": [{"role": "user", "content": "What is 4821 * 7395?"}],
}


def call(expression: str) -> str:
    body = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


def test_the_calculator_does_arithmetic_and_nothing_else():
    assert calculator("4821 * 7395") == "35651295"
    assert calculator("(7 - 10) // 2 + 1.5 * 2") == "1"
    assert calculator("-3 % 5") == "2"
    for bad, error in [
        ("__import__('os').system('true')", "not arithmetic"),
        ("9 ** 9 ** 9", "not arithmetic"),
        ("10 ** 2", "not arithmetic"),
        ("99999999999999999999999 * 99999999999999999999999", "more than 40 digits"),
        ("1e300", "more than 40 digits"),
        ("1e400 - 1e400", "not finite"),
        ("1 + " * 100 + "1", "more than 200 characters"),
    ]:
        with pytest.raises(ValueError, match=error):
            calculator(bad)


async def test_a_tool_turn_gets_its_results_and_the_answer_turn_ends_the_episode():
    task = ToolTask(ROW, tools=["calculator"])
    first = await task.reset()
    assert first[0]["role"] == "system" and "calculator" in first[0]["content"]
    assert first[1:] == ROW["prompt"]
    step = await task.step(f"Let me compute. {call('4821 * 7395')} {call('4821 *')}")
    assert not step.done
    assert step.messages[0] == {"role": "tool", "content": "35651295"}
    assert step.messages[1]["content"].startswith("error: calculator raised SyntaxError")
    assert step.metrics == {"tool_calls": 2, "well_formed_calls": 2, "tool_errors": 1}
    done = await task.step("<answer>35651295</answer>")
    assert (done.done, done.reward, done.messages) == (True, 0.0, [])  # reward: the run's


async def test_without_tools_the_first_turn_is_the_answer_even_if_it_calls_one():
    task = ToolTask(ROW)
    assert await task.reset() == ROW["prompt"]
    step = await task.step(f"{call('1 + 1')} <answer>35651296</answer>")
    assert step.done and step.metrics == {}


def test_an_unknown_tool_fails_when_the_environment_is_made():
    with pytest.raises(ValueError, match=r"tools: \['abacus'\] unknown"):
        ToolTask(ROW, tools=["abacus"])


async def test_guess_a_number_answers_higher_or_lower_until_found():
    task = GuessNumber({"index": 3}, high=16)
    secret = task.secret
    assert "1 to 16" in (await task.reset())[0]["content"]
    low = await task.step(f"I guess {secret - 1}" if secret > 1 else "no idea")
    assert low.messages[0]["content"] in ("higher", "A number, please.")
    found = await task.step(str(secret))
    assert (found.done, found.reward) == (True, 0.9)
    assert GuessNumber({"index": 3}).secret == secret  # the row decides it
