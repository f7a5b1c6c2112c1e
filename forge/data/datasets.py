"""Prompt datasets: rows with a chat prompt and a verifiable answer, in a resumable order.

Every dataset yields rows shaped for the rollout loop and the reward functions
(forge.data.rewards):

    {"prompt": [{"role": "user", "content": "Calculate 3 + 4.\\n\\nPut your final ..."}],
     "question": "Calculate 3 + 4.", "answer": "7", "task": "basic_arithmetic",
     "index": 12, "metadata": {...}}

`next(dataset)` hands out rows forever: each epoch visits every row once, in an order fixed by
`seed` and the epoch number; `epoch` counts finished passes, and `state_dict()` /
`load_state_dict()` resume exactly where a run stopped.

Two sources:
    ReasoningGymDataset  reasoning-gym's procedural tasks, by name and task config.
                         `easy_arithmetic()` is a task SmolLM2-135M can already partly solve.
    LocalDataset         a Hugging Face dataset on local disk: a `save_to_disk` folder, or a
                         json / jsonl / parquet / csv file, with configurable column names.

Malformed data (LocalDataset) is found when the dataset is built, before any rollout:
    - a prompt or answer column that is absent raises DatasetError naming the column;
    - a row whose prompt or answer is null, empty or of the wrong type raises DatasetError naming
      the row index and the column (`on_bad_row="raise"`, the default), or, with
      `on_bad_row="skip"`, is left out of the order with one warning that counts the skipped
      rows; `dataset.skipped` maps each one's index to its message. Nothing is dropped silently;
    - a file the loader cannot read at all (e.g. a json column that is a number in one row and
      an object in another while other rows lack some key) raises DatasetError naming the
      first malformed row if there is one, else the loader's own one-line reason.
"""

import functools
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from forge.data.rewards import ANSWER_INSTRUCTION

# `datasets` and `reasoning_gym` are imported by the source that reads them: ~1.5 s of CPU in
# every process that imports this module only for its configs.
if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

Row = dict[str, Any]
Messages = list[dict[str, str]]


class DatasetError(ValueError):
    """A dataset that cannot be built: the message is one line naming the source, row, column."""


@dataclass
class PromptTemplate:
    """Turns a question into chat messages.

    Args:
        system: the system message, or None for none (the model's chat template may add one).
        user: the user message; "{question}" is replaced by the question (no other braces are
            interpreted, so a template may mention `\\boxed{}`).
    """

    system: str | None = None
    user: str = "{question}\n\n" + ANSWER_INSTRUCTION

    def messages(self, question: str) -> Messages:
        """The chat messages asking `question`."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.user.replace("{question}", question)})
        return messages


class PromptDataset:
    """Rows in a seeded order, epoch after epoch, resumable. Subclasses implement `row`.

    Args:
        name: names the source in errors and in the state dict.
        indices: the source indices to visit (all rows but skipped ones).
        seed: fixes the order of every epoch.
        shuffle: False visits rows in source order every epoch.
    """

    def __init__(self, name: str, indices: list[int], seed: int, shuffle: bool) -> None:
        if not indices:
            raise DatasetError(f"{name}: no usable rows")
        self.name = name
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._indices = indices
        self._position = 0
        self._order = self._epoch_order(0)

    def row(self, index: int) -> Row:
        """The row at source index `index`."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._indices)

    def __iter__(self) -> "PromptDataset":
        return self

    def __next__(self) -> Row:
        """The next row; never stops (`epoch` counts the passes)."""
        row = self.row(self._order[self._position])
        self._position += 1
        if self._position == len(self._order):
            self.epoch += 1
            self._position = 0
            self._order = self._epoch_order(self.epoch)
        return row

    def nth(self, n: int) -> Row:
        """The n-th row of the whole iteration (epoch n // len, position n % len).

        Concurrent consumers that number their requests get the same row for the same number,
        whatever order their calls arrive in.
        """
        epoch, position = divmod(n, len(self))
        return self.row(self._epoch_order(epoch)[position])

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands: enough for `load_state_dict` to continue from here."""
        return {
            "name": self.name,
            "size": len(self),
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self._position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a `state_dict()` taken on the same dataset (same source, size, seed).

        Raises:
            DatasetError: the state comes from a different dataset, so its order would differ.
        """
        mine = (self.name, len(self), self.seed)
        theirs = (state["name"], state["size"], state["seed"])
        if mine != theirs:
            raise DatasetError(
                f"cannot resume: state is for (name, size, seed) = {theirs}, this dataset is {mine}"
            )
        self.epoch = state["epoch"]
        self._position = state["position"]
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(self._indices)
        if self.shuffle:
            # String seeds hash with sha512: the same order on every platform and Python version.
            random.Random(f"forge:{self.seed}:{epoch}").shuffle(order)
        return order


@dataclass
class ReasoningGymConfig:
    """A reasoning-gym procedural task.

    Args:
        task: the reasoning-gym dataset name ("basic_arithmetic", "chain_sum", "gsm_symbolic").
        config: the task's own options (its `*Config` dataclass fields, e.g. max_terms).
        size: rows per epoch; reasoning-gym generates row i from (seed, i).
        seed: fixes both the generated rows and the order.
        shuffle: reorder rows each epoch.
        template: how a question becomes chat messages.
    """

    task: str = "basic_arithmetic"
    config: dict[str, Any] = field(default_factory=dict)
    size: int = 10_000
    seed: int = 0
    shuffle: bool = True
    template: PromptTemplate = field(default_factory=PromptTemplate)


def easy_arithmetic(size: int = 10_000, seed: int = 0) -> ReasoningGymConfig:
    """Additions of two one-digit numbers ("Calculate 3 + 4."): a task with reward to learn from.

    SmolLM2-135M-Instruct answers one-digit additions right about 78% of the time greedily,
    while reasoning-gym's default `basic_arithmetic` (up to 6 terms of up to 4 digits, all four
    operators) gives it a sampled reward near 0.007: no signal for GRPO. This config aims at a
    sampled (T=1) base reward of roughly 0.2-0.6; measure it before relying on it. As yaml:

        task: basic_arithmetic
        config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ["+"],
                 allow_parentheses: false, allow_negation: false}
    """
    return ReasoningGymConfig(
        task="basic_arithmetic",
        config={
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
            "operators": ["+"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
        size=size,
        seed=seed,
    )


class ReasoningGymDataset(PromptDataset):
    """Rows from a reasoning-gym task; score them with the "reasoning_gym" reward."""

    def __init__(self, config: ReasoningGymConfig) -> None:
        import reasoning_gym

        self.config = config
        try:
            self._source = reasoning_gym.create_dataset(
                config.task, size=config.size, seed=config.seed, **config.config
            )
        except (ValueError, TypeError, AssertionError) as e:
            # Unknown task (ValueError), unknown option (TypeError), failed validate() (assert).
            raise DatasetError(f"reasoning-gym task {config.task!r}: {e}") from e
        name = f"reasoning_gym:{config.task}"
        super().__init__(name, list(range(config.size)), config.seed, config.shuffle)

    def row(self, index: int) -> Row:
        """Row `index` of the task, generated on demand."""
        entry = self._source[index]
        return {
            "prompt": self.config.template.messages(entry["question"]),
            "question": entry["question"],
            "answer": entry["answer"],
            "task": self.config.task,
            "index": index,
            "metadata": entry["metadata"],
        }


_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class LocalDatasetConfig:
    """A Hugging Face dataset on local disk.

    Args:
        path: a `Dataset.save_to_disk` folder, or one .json/.jsonl/.parquet/.csv file.
        split: the split to use when the folder holds a DatasetDict.
        prompt_column: a question string (put into `template`) or a list of chat messages
            ({"role", "content"} dicts, used as they are).
        answer_column: the reference answer, a string or a number (rows carry it as a string).
        task: the rows' "task"; empty: the file or folder name.
        seed: fixes the order.
        shuffle: reorder rows each epoch.
        on_bad_row: "raise" (default) or "skip" rows whose prompt or answer is malformed.
        cache_dir: where Hugging Face keeps the Arrow copy of a file; None: its default.
        template: how a question string becomes chat messages.
    """

    path: str
    split: str = "train"
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    task: str = ""
    seed: int = 0
    shuffle: bool = True
    on_bad_row: Literal["raise", "skip"] = "raise"
    cache_dir: str | None = None
    template: PromptTemplate = field(default_factory=PromptTemplate)

    def __post_init__(self) -> None:
        if self.on_bad_row not in ("raise", "skip"):
            raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {self.on_bad_row!r}")


class LocalDataset(PromptDataset):
    """Rows from a local Hugging Face dataset, checked row by row when built.

    Raises:
        DatasetError: the path cannot be loaded, a column is absent, or (with
            `on_bad_row="raise"`) a row is malformed; one line naming the row and the column.
    """

    def __init__(self, config: LocalDatasetConfig) -> None:
        self.config = config
        self._data = _load(config)
        columns = (config.prompt_column, config.answer_column)
        for column, key in zip(columns, ("prompt_column", "answer_column"), strict=True):
            if column not in self._data.column_names:
                raise DatasetError(
                    f"{config.path}: no column {column!r} (columns: "
                    f"{', '.join(self._data.column_names)}); set {key}"
                )
        # Source index -> why that row is malformed.
        self.skipped = _malformed_rows(self._data, config)
        if self.skipped:
            first = next(iter(self.skipped.values()))
            if config.on_bad_row == "raise":
                more = len(self.skipped) - 1
                hint = f" (and {more} more malformed rows; on_bad_row='skip' skips them)"
                raise DatasetError(first + (hint if more else ""))
            logger.warning(
                "%s: skipping %d malformed rows; first: %s", config.path, len(self.skipped), first
            )
        indices = [i for i in range(len(self._data)) if i not in self.skipped]
        super().__init__(f"local:{config.path}", indices, config.seed, config.shuffle)

    def row(self, index: int) -> Row:
        """Row `index` of the file; columns other than prompt and answer go to metadata."""
        record = dict(self._data[index])
        prompt = record.pop(self.config.prompt_column)
        answer = record.pop(self.config.answer_column)
        if isinstance(prompt, str):
            question, messages = prompt, self.config.template.messages(prompt)
        else:
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
            question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return {
            "prompt": messages,
            "question": question,
            "answer": str(answer),
            "task": self.config.task or Path(self.config.path).stem,
            "index": index,
            "metadata": record,
        }


def _load(config: LocalDatasetConfig) -> "datasets.Dataset":
    import datasets

    path = Path(config.path)
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if config.split not in loaded:
                raise DatasetError(
                    f"{path}: no split {config.split!r} (splits: {', '.join(loaded)}); set split"
                )
            loaded = loaded[config.split]
        return loaded
    if not path.is_file():
        raise DatasetError(f"{path}: no such file or folder")
    builder = _FILE_BUILDERS.get(path.suffix)
    if builder is None:
        raise DatasetError(f"{path}: unknown file type; use {', '.join(_FILE_BUILDERS)}")
    load = functools.partial(
        datasets.load_dataset,
        builder,
        data_files=str(path),
        split="train",
        cache_dir=config.cache_dir,
    )
    try:
        if builder != "json":
            return load()
        try:
            return load()
        except Exception:
            # datasets 4.7's json loader reads a key absent from some rows only with its
            # mixed-type detection off (on, it raises KeyError), and mixed types only with it on.
            return load(on_mixed_types=None)
    except Exception as e:
        # The loaders fail in many ways (KeyError, pyarrow errors): read a json file ourselves
        # to name the bad row, else report the root cause (pyarrow's names column and row).
        problem = _json_problem(path, config) if builder == "json" else None
        while e.__cause__ is not None:
            e = e.__cause__
        raise DatasetError(problem or f"{path}: cannot load: {type(e).__name__}: {e}") from e


def _json_problem(path: Path, config: LocalDatasetConfig) -> str | None:
    """The first malformed row of a json/jsonl file, if any (see `_malformed_rows`)."""
    text = path.read_text(encoding="utf-8")
    try:
        records = json.loads(text)
        records = records if isinstance(records, list) else [records]
    except json.JSONDecodeError:
        records = []
        for line_number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                return f"{path} line {line_number} (row {len(records)}): not valid JSON: {e.msg}"
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            return f"{path} row {index}: a {type(record).__name__}, not a JSON object"
        problem = _row_problem(record, config)
        if problem:
            return f"{path} row {index}: {problem}"
    return None


def _malformed_rows(data: "datasets.Dataset", config: LocalDatasetConfig) -> dict[int, str]:
    """Row index -> "<path> row <i>: column '<name>' <problem>", for each malformed row."""
    columns = data.select_columns([config.prompt_column, config.answer_column])
    messages = {}
    for index, record in enumerate(columns):
        problem = _row_problem(record, config)
        if problem:
            messages[index] = f"{config.path} row {index}: {problem}"
    return messages


def _row_problem(record: dict[str, Any], config: LocalDatasetConfig) -> str | None:
    """What is wrong with a row's prompt or answer ("column 'q' is null"), or None."""
    for column, check in (
        (config.prompt_column, _prompt_problem),
        (config.answer_column, _answer_problem),
    ):
        if column not in record:
            return f"no column {column!r}"
        problem = check(record[column])
        if problem:
            return f"column {column!r} {problem}"
    return None


def _prompt_problem(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None if prompt.strip() else "is an empty string"
    if isinstance(prompt, list) and prompt:
        chat = all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        )
        return None if chat else "is a list but not chat messages ({role, content} strings)"
    return _type_problem(prompt, "a string or chat messages")


def _answer_problem(answer: Any) -> str | None:
    if isinstance(answer, str):
        return None if answer.strip() else "is an empty string"
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        return None
    return _type_problem(answer, "a string or a number")


def _type_problem(value: Any, expected: str) -> str:
    if value is None:
        return "is null"
    return f"is a {type(value).__name__} ({str(value)[:40]!r}), expected {expected}"
