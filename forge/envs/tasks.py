"""Tasks forge ships as environments: a question answered with the help of tools, and
guess-a-number. Any data section's rows feed them (`row["prompt"]`, `row["answer"]`).

`ToolTask` is the general case of the single-turn task (the `env` section's default): without
tools, the first turn is the answer; with tools, each turn that calls tools gets their results
as `tool` messages, and the first turn that calls none is the answer. The run's reward
functions (the `reward` section) score that answer, as they score a single-turn one.
"""

import ast
import operator
import random
import re
from typing import Any

from forge.envs.environment import Message, StepResult
from forge.envs.sandbox import Sandbox
from forge.envs.tools import ToolBox, python_tool

TOOL_FORMAT = (
    'To call a tool, write <tool_call>{"name": "calculator", "arguments": {"expression": '
    '"12 * 34"}}</tool_call> and wait for its result. Tools: {tools}.'
)
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_DIGITS = 40
_MAX_CHARS = 200


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression: numbers, + - * / // % and parentheses."""
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"an expression of more than {_MAX_CHARS} characters")

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return _bounded(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _bounded(_BINARY[type(node.op)](value(node.left), value(node.right)))
        raise ValueError(f"not arithmetic: {ast.unparse(node)[:40]!r}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result) if isinstance(result, float) and result.is_integer() else result)


def _bounded(number: int | float) -> int | float:
    if not abs(number) < 10**_MAX_DIGITS:  # also inf and nan
        raise ValueError(f"a number of more than {_MAX_DIGITS} digits, or not finite")
    return number


class ToolTask:
    """A data row's question and the tools to answer it with; it ends at the answer, which the
    run's reward functions score (the environment itself rewards nothing).

    Args:
        row: the data row (its `prompt` messages).
        tools: "calculator" (arithmetic, in process) and "python" (code, in the sandbox), or
            none: a single-turn task.
    """

    def __init__(self, row: dict[str, Any], tools: list[str] | None = None) -> None:
        self.row = row
        unknown = sorted(set(tools or []) - {"calculator", "python"})
        if unknown:
            raise ValueError(f"tools: {unknown} unknown; forge's are calculator and python")
        made = {"calculator": lambda: calculator, "python": lambda: python_tool(Sandbox())}
        self.toolbox = ToolBox([made[name]() for name in tools or []])

    async def reset(self) -> list[Message]:
        messages = list(self.row["prompt"])
        if self.toolbox.tools:
            tools = self.toolbox.tools.values()
            names = ", ".join(f"{t.name}: {t.description.rstrip('.')}" for t in tools)
            system = {"role": "system", "content": TOOL_FORMAT.replace("{tools}", names)}
            messages = [system, *[m for m in messages if m["role"] != "system"]]
        return messages

    async def step(self, text: str) -> StepResult:
        calls = await self.toolbox.call_all(text) if self.toolbox.tools else []
        if calls:
            answers = [c.output if c.ok else f"error: {c.output}" for c in calls]
            counts = {
                "tool_calls": len(calls),
                "well_formed_calls": sum(c.well_formed for c in calls),
                "tool_errors": sum(not c.ok for c in calls),
            }
            return StepResult([{"role": "tool", "content": a} for a in answers], metrics=counts)
        return StepResult(done=True)

    async def close(self) -> None:
        pass


class GuessNumber:
    """Guess a number from 1 to `high` (drawn from the row's index): "higher" or "lower" after
    each wrong guess; reward 1 for the right one, less 0.1 per extra guess (never below 0)."""

    def __init__(self, row: dict[str, Any], high: int = 16) -> None:
        self.high = high
        self.secret = random.Random(row["index"]).randint(1, high)
        self.guesses = 0

    async def reset(self) -> list[Message]:
        question = (
            f"I am thinking of a number from 1 to {self.high}. Guess it: answer with the "
            "number alone. I will say higher or lower."
        )
        return [{"role": "user", "content": question}]

    async def step(self, text: str) -> StepResult:
        self.guesses += 1
        numbers = re.findall(r"-?\d+", text)
        if not numbers:
            return StepResult([{"role": "user", "content": "A number, please."}])
        guess = int(numbers[-1])
        if guess == self.secret:
            reward = max(0.0, 1.0 - 0.1 * (self.guesses - 1))
            return StepResult(done=True, reward=reward, rewards={"found": 1.0})
        hint = "higher" if guess < self.secret else "lower"
        return StepResult([{"role": "user", "content": hint}], metrics={"guesses": 1})

    async def close(self) -> None:
        pass
