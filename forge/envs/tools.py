"""Tools a model calls from its text: typed Python functions, and code run in the sandbox.

A call is written as the Hermes / Qwen3 chat templates teach it, a JSON object between tags:

    <tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>

`ToolBox.call_all(text)` finds every call in a turn's text and answers each with one line of
result or of error. A malformed call (not JSON, an unknown tool, a missing, extra or mistyped
argument, too many calls in one turn) gets an error that names what is wrong, so that the
model can learn from it; it never raises. Function tools run in the caller's process, under a
time limit past which the call is answered with an error (a thread cannot be killed: a
function that may never return belongs in the sandbox); code the model writes runs in the
sandbox (`python_tool`).
"""

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from forge.envs.sandbox import Sandbox

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
JSON_TYPES |= {list: "array", dict: "object"}


@dataclass
class Tool:
    """A function the model may call by name.

    Args:
        name: what the model calls it.
        description: what it does, for the prompt.
        parameters: name -> Python type (int, float, str, bool, list or dict).
        required: the parameters without a default.
        fn: the function, sync or async, called with the arguments by name.
    """

    name: str
    description: str
    parameters: dict[str, type]
    required: list[str]
    fn: Callable[..., Any]

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> "Tool":
        """A tool from a function with type hints on every parameter; its docstring's first
        line describes it."""
        hints = typing.get_type_hints(fn)
        parameters, required = {}, []
        for name, p in inspect.signature(fn).parameters.items():
            kind = hints.get(name)
            if kind not in JSON_TYPES:
                raise TypeError(
                    f"tool {fn.__name__}: parameter {name!r} needs a type hint of "
                    f"{[t.__name__ for t in JSON_TYPES]}, not {kind}"
                )
            parameters[name] = kind
            if p.default is inspect.Parameter.empty:
                required.append(name)
        description = (inspect.getdoc(fn) or fn.__name__).splitlines()[0]
        return cls(fn.__name__, description, parameters, required, fn)

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates render (`tools=`)."""
        properties = {name: {"type": JSON_TYPES[kind]} for name, kind in self.parameters.items()}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": properties,
                    "required": self.required,
                },
            },
        }

    def check(self, arguments: Any) -> str | None:
        """What is wrong with `arguments`, or None."""
        if not isinstance(arguments, dict):
            return f"arguments must be an object, not {type(arguments).__name__}"
        missing = [name for name in self.required if name not in arguments]
        extra = [name for name in arguments if name not in self.parameters]
        if missing or extra:
            return f"missing arguments {missing}, unknown arguments {extra}"
        for name, value in arguments.items():
            if not _is(value, self.parameters[name]):
                expected = JSON_TYPES[self.parameters[name]]
                return f"argument {name!r} must be {expected}, not {json.dumps(value)[:40]}"
        return None


@dataclass
class ToolResult:
    """One call's answer. `well_formed`: the call parsed and named a tool with arguments it
    takes; `ok`: and the tool answered (it did not raise or time out)."""

    name: str
    ok: bool
    output: str
    well_formed: bool = True


class ToolBox:
    """The tools of an environment, and the parsing and calling of what a turn asks of them.

    Args:
        tools: the tools (functions, or `Tool`s).
        timeout_s: each function call's time limit.
        max_calls: calls answered per turn; those beyond get an error.
        output_chars: each answer is cut to this many characters.
    """

    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any]],
        timeout_s: float = 10.0,
        max_calls: int = 4,
        output_chars: int = 1000,
    ) -> None:
        self.tools = {t.name: t for t in (t if isinstance(t, Tool) else Tool.of(t) for t in tools)}
        self.timeout_s, self.max_calls, self.output_chars = timeout_s, max_calls, output_chars

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools.values()]

    async def call_all(self, text: str) -> list[ToolResult]:
        """Answers every call in `text`, in order (none: an empty list)."""
        calls = CALL.findall(text)
        answers = [self._call(body) for body in calls[: self.max_calls]]
        results = list(await asyncio.gather(*answers))
        too_many = f"more than {self.max_calls} calls in a turn"
        results += [ToolResult("", False, too_many, False) for _ in calls[self.max_calls :]]
        return results

    async def _call(self, body: str) -> ToolResult:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolResult("", False, f"the call is not JSON: {e}", False)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolResult("", False, 'a call is {"name": ..., "arguments": {...}}', False)
        name = call["name"]
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(name, False, f"no tool {name!r}; tools: {sorted(self.tools)}", False)
        problem = tool.check(call.get("arguments", {}))
        if problem:
            return ToolResult(name, False, f"{name}: {problem}", False)
        try:
            async with asyncio.timeout(self.timeout_s):
                output = await _run(tool.fn, call.get("arguments", {}))
        except TimeoutError:
            return ToolResult(name, False, f"{name}: no answer within {self.timeout_s} s")
        except Exception as e:  # the tool's own failure is the model's observation
            return ToolResult(name, False, f"{name} raised {type(e).__name__}: {e}")
        return ToolResult(name, True, str(output)[: self.output_chars])


def python_tool(sandbox: Sandbox) -> Tool:
    """A tool `python(code)` that runs the model's code in `sandbox` and answers with what it
    printed, or the error's last line."""

    async def python(code: str) -> str:
        """Runs Python code and returns what it prints."""
        result = await sandbox.run(code)
        if result.status == "ok":
            return result.stdout
        if result.status == "error":
            lines = result.stderr.strip().splitlines()
            raise RuntimeError(lines[-1] if lines else f"exit code {result.exit_code}")
        raise RuntimeError(f"stopped: {result.status} limit")

    return Tool.of(python)


async def _run(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(**arguments)
    return await asyncio.to_thread(fn, **arguments)


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)
