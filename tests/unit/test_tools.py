"""Tool calls parsed from a turn's text: typed functions become tools, and every malformed or
abusive call is answered with an error naming what is wrong, never an exception."""

import json
import threading

import pytest

from forge.envs.tools import Tool, ToolBox


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Longer text the prompt does not need."""
    return a * b


async def divide(a: float, b: float = 1.0) -> float:
    """Divides a by b."""
    return a / b


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_typed_function_becomes_a_tool_with_its_schema():
    tool = Tool.of(divide)
    assert tool.schema() == {
        "type": "function",
        "function": {
            "name": "divide",
            "description": "Divides a by b.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a"],
            },
        },
    }
    assert Tool.of(multiply).description == "Multiplies two integers."


def test_a_parameter_without_a_json_type_is_refused_when_the_tool_is_made():
    def untyped(x):
        return x

    with pytest.raises(TypeError, match="untyped: parameter 'x' needs a type hint"):
        Tool.of(untyped)


async def test_well_formed_calls_are_answered_in_order_sync_and_async():
    box = ToolBox([multiply, divide])
    text = f"First {call('multiply', a=12, b=34)} then {call('divide', a=1, b=4)}."
    results = await box.call_all(text)
    assert [(r.name, r.ok, r.output) for r in results] == [
        ("multiply", True, "408"),
        ("divide", True, "0.25"),
    ]
    assert await box.call_all("no call here") == []


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{'name': 'multiply'}</tool_call>", "the call is not JSON: Expecting"),
        ('<tool_call>["multiply", 1, 2]</tool_call>', 'a call is {"name": ..., "arguments"'),
        (call("add", a=1, b=2), "no tool 'add'; tools: ['divide', 'multiply']"),
        (call("multiply", a=1), "multiply: missing arguments ['b'], unknown arguments []"),
        (call("multiply", a=1, b=2, c=3), "missing arguments [], unknown arguments ['c']"),
        (call("multiply", a=1, b="2"), "multiply: argument 'b' must be integer, not \"2\""),
        (call("multiply", a=True, b=2), "argument 'a' must be integer, not true"),
        (call("divide", a=1, b=0), "divide raised ZeroDivisionError: division by zero"),
        ('<tool_call>{"name": "divide", "arguments": [1]}</tool_call>', "must be an object"),
    ],
    ids=[
        "not json",
        "not an object",
        "unknown tool",
        "missing argument",
        "extra argument",
        "wrong type",
        "bool for int",
        "tool raises",
        "arguments not an object",
    ],
)
async def test_a_malformed_call_is_answered_with_what_is_wrong(text, error):
    (result,) = await ToolBox([multiply, divide]).call_all(text)
    assert not result.ok
    assert error in result.output
    assert result.well_formed == ("raised" in error)  # only the tool's own failure parsed


async def test_calls_beyond_the_limit_and_output_beyond_its_size_are_refused_and_cut():
    def echo(text: str) -> str:
        """Says it back."""
        return text

    box = ToolBox([echo], max_calls=2, output_chars=5)
    results = await box.call_all(call("echo", text="0123456789") * 3)
    assert [(r.ok, r.output) for r in results] == [
        (True, "01234"),
        (True, "01234"),
        (False, "more than 2 calls in a turn"),
    ]


async def test_a_function_past_its_time_limit_is_answered_and_the_turn_goes_on():
    release = threading.Event()

    def stuck(x: int) -> int:
        """Never answers in time."""
        release.wait()
        return x

    box = ToolBox([stuck, multiply], timeout_s=0.2)
    slow, fast = await box.call_all(call("stuck", x=1) + call("multiply", a=2, b=3))
    release.set()
    assert (slow.ok, slow.output) == (False, "stuck: no answer within 0.2 s")
    assert (fast.ok, fast.output) == (True, "6")
