"""Reward functions: plain functions that score one completion of one dataset row.

The exact signature of a reward function, built in or a user's `module:function`:

    def my_reward(row: Mapping[str, Any], text: str) -> float

`row` is the dataset row the prompt came from (forge.data.datasets), the same for every data
source: `row["answer"]` is the reference answer (the data's `answer_column`, as a string),
`row["question"]`, `row["prompt"]` (chat messages), `row["task"]`, `row["index"]`, and
`row["columns"]`, the source row as stored: every column of a file under its own name. `text`
is the completion's text. A function that reads a column declares it with `@reads_columns`, so
a run whose data lacks it fails before it starts (`check_columns`) instead of at its first
rollout.

Our own answer extraction never raises because of what the model wrote: text it cannot read
scores 0. A reward function does raise on a row it cannot use (no `answer`, a reference answer
that is not math), and when the checker it calls raises (a reasoning-gym `score_answer`,
math-verify's comparison): RewardActor then counts the call as the function's failure and logs
it, rather than hide a checker's bug behind a score of 0 that looks like a wrong answer.

Expected answer format, which `ANSWER_INSTRUCTION` asks for (forge.data.datasets puts it in
every prompt by default):

    ... any reasoning ... <answer>42</answer>

`extract_answer` reads, in order of preference, the last `<answer>...</answer>` block, the last
`\\boxed{...}`, and otherwise the last number in the text (so a model that has not learned the
tags yet still earns reward for a right number on arithmetic tasks).

Built-in functions, by registry name (`REWARD_FUNCTIONS`):
    reasoning_gym  the task's own `score_answer(answer, entry)` on the extracted answer; reads
                   the `metadata` column (a reasoning-gym task's rows, or a file of them).
    math_verify    math-verify's parse + verify of the answer against the reference, so that
                   "1/2", "0.5" and "\\frac{1}{2}" are all the same answer.
    format         1 for exactly one non-empty `<answer>` block ending the text, else 0.
"""

import functools
import importlib
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from forge.imports import import_callable

RewardFn = Callable[[Mapping[str, Any], str], float]
F = TypeVar("F", bound=RewardFn)

ANSWER_INSTRUCTION = "Put your final answer between <answer> and </answer> tags."

# Thousands separators only in groups of three, so "1,2,3" is three numbers, not 123.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_BOXED = "\\boxed{"

# math-verify's own timeouts (seconds) stop a pathological expression early without killing the
# worker process; RewardActor's per-call deadline is the hard bound.
MATH_VERIFY_TIMEOUT_S = 3


def extract_tagged(text: str, tag: str = "answer") -> str | None:
    """The stripped content of the last complete `<tag>...</tag>` block, or None."""
    matches = _tagged_pattern(tag).findall(text)
    return matches[-1].strip() if matches else None


@functools.cache
def _tagged_pattern(tag: str) -> re.Pattern[str]:
    # The content may not hold another opening tag: "<answer><answer>1</answer>" answers "1".
    tag = re.escape(tag)
    return re.compile(f"<{tag}>((?:(?!<{tag}>).)*?)</{tag}>", re.DOTALL)


def extract_boxed(text: str) -> str | None:
    """The stripped content of the last `\\boxed{...}` whose braces balance, or None."""
    end = len(text)
    start = text.rfind(_BOXED)
    while start >= 0:
        depth = 1
        for i in range(start + len(_BOXED), end):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len(_BOXED) : i].strip()
        # Unbalanced (the completion was cut off): try an earlier one. It can only close before
        # this one starts (this one's braces never close), so scanning stays linear.
        end = start
        start = text.rfind(_BOXED, 0, start)
    return None


def extract_last_number(text: str) -> str | None:
    """The last number in the text ("-12", "3.5", "1,234" -> "1234"), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer(text: str) -> str | None:
    """The model's final answer: last `<answer>` block, else last `\\boxed{}`, else last number.

    Returns None when the text holds none of them. Never raises.
    """
    for extract in (extract_tagged, extract_boxed, extract_last_number):
        answer = extract(text)
        if answer is not None:
            return answer
    return None


def reads_columns(*columns: str) -> Callable[[F], F]:
    """Declares the data columns a reward function reads from `row["columns"]`:

        @reads_columns("difficulty")
        def harder_is_better(row, text): ...

    A run whose data (or eval data) lacks one of them fails before any process starts.
    """

    def declare(fn: F) -> F:
        fn.columns = tuple(columns)  # type: ignore[attr-defined]
        return fn

    return declare


def check_columns(functions: Mapping[str, RewardFn], source: str, columns: Sequence[str]) -> None:
    """Raises ValueError naming each column a function declares (`reads_columns`) and the
    `columns` of `source` lack: "f reads column 'x', which <source> lacks (columns: ...)"."""
    missing = [
        f"{name} reads column {column!r}"
        for name, fn in functions.items()
        for column in getattr(fn, "columns", ())
        if column not in columns
    ]
    if missing:
        raise ValueError(
            f"{'; '.join(missing)}, which {source} lacks (columns: {', '.join(columns)})"
        )


@reads_columns("metadata")
def reasoning_gym_reward(row: Mapping[str, Any], text: str) -> float:
    """Scores the extracted answer with the reasoning-gym task's own `score_answer`.

    The row's `metadata` column names the task in `source_dataset` (reasoning-gym sets it);
    without it, the row's `task` must be a reasoning-gym task name.

    Raises:
        KeyError: the row has no `answer`, or neither a source dataset nor a `task`.
        Exception: whatever the task's checker raises, unchanged.
    """
    entry = {
        "question": row.get("question", ""),
        "answer": _required(row, "answer"),
        "metadata": row.get("columns", {}).get("metadata") or {},
    }
    task = entry["metadata"].get("source_dataset") or _required(row, "task")
    score_answer = _reasoning_gym_scorer(task)
    answer = extract_answer(text)
    if answer is None:
        return 0.0
    # Not caught: a checker that raises (some parse the answer and raise on what they cannot
    # read) is counted as this function's failure by the caller, never silently scored 0.
    return float(score_answer(answer, entry))


@functools.cache
def _reasoning_gym_scorer(task: str) -> Callable[[str, dict[str, Any]], float]:
    # Built once per process: get_score_answer_fn instantiates the task's dataset class.
    import reasoning_gym  # here: see load_libraries

    return reasoning_gym.get_score_answer_fn(task)


def math_verify_reward(row: Mapping[str, Any], text: str) -> float:
    """1.0 if math-verify finds the answer equal to the row's `answer`, else 0.0.

    The answer is the last `<answer>` block if there is one; otherwise math-verify extracts it
    from the whole text (it looks for `\\boxed{}`, "the final answer is", the last expression).

    Raises:
        ValueError: the row's reference answer is not something math-verify can parse.
        TimeoutError: math-verify's comparison ran past its timeout.
        Exception: whatever else math-verify's comparison raises (it would return False).
    """
    from math_verify import parse, verify  # here: see load_libraries
    from math_verify.errors import TimeoutException

    timeout = _math_verify_timeout()
    reference = str(_required(row, "answer"))
    gold = parse(reference, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {reference!r}")
    tagged = extract_tagged(text)
    predicted = parse(tagged if tagged is not None else text, parsing_timeout=timeout)
    if not predicted:
        return 0.0
    try:
        # raise_on_error: math-verify would log a failed comparison at debug level and return
        # False, a wrong answer to every reader of the score.
        equal = verify(gold, predicted, timeout_seconds=timeout, raise_on_error=True)
    except TimeoutException as e:  # a BaseException: the reward worker would die of it
        raise TimeoutError(f"math-verify comparison ran past {timeout} s") from e
    return 1.0 if equal else 0.0


def _math_verify_timeout() -> int | None:
    # math-verify times out with signal.alarm, which works only on a process's main thread
    # (elsewhere it raises): off the main thread the caller's deadline must bound the call.
    on_main = threading.current_thread() is threading.main_thread()
    return MATH_VERIFY_TIMEOUT_S if on_main else None


def format_reward(row: Mapping[str, Any], text: str) -> float:
    """1.0 if the text has exactly one non-empty `<answer>` block and nothing after it."""
    blocks = _tagged_pattern("answer").findall(text)
    if len(blocks) != 1 or not blocks[0].strip():
        return 0.0
    return 1.0 if text.rstrip().endswith("</answer>") else 0.0


def _required(row: Mapping[str, Any], key: str) -> Any:
    if row.get(key) is None:
        raise KeyError(f"reward needs row[{key!r}], the row has keys {sorted(row)}")
    return row[key]


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "reasoning_gym": reasoning_gym_reward,
    "math_verify": math_verify_reward,
    "format": format_reward,
}


# The library each built-in reward imports on first use rather than at import: a run's driver,
# which only names them, need not pay seconds of CPU for reasoning_gym's every task and
# math-verify's sympy.
_LIBRARIES = {reasoning_gym_reward: "reasoning_gym", math_verify_reward: "math_verify"}


def load_libraries(functions: Iterable[RewardFn]) -> None:
    """Imports the libraries the built-in rewards among `functions` use, so that a process
    that scores (a reward worker, as it loads its functions) pays for them before its first
    call's deadline rather than during it."""
    for fn in functions:
        if (library := _LIBRARIES.get(fn)) is not None:
            importlib.import_module(library)


def resolve_reward(spec: str) -> RewardFn:
    """The reward function named `spec`: a `REWARD_FUNCTIONS` name or a "module:function" path.

    Raises:
        ValueError: neither a known name nor an importable "module:function".
    """
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if ":" not in spec:
        known = ", ".join(sorted(REWARD_FUNCTIONS))
        raise ValueError(f"unknown reward function {spec!r}: use one of {known} or module:function")
    return import_callable(spec, "reward function")
