"""Prompt datasets: the `data:` section every app shares, its sources, rows in a resumable order.

Every source yields rows shaped for the rollout loop and the reward functions
(forge.data.rewards):

    {"prompt": [{"role": "user", "content": "Calculate 3 + 4.\\n\\nPut your final ..."}],
     "question": "Calculate 3 + 4.", "answer": "7", "task": "basic_arithmetic", "index": 12,
     "columns": {"question": ..., "answer": ..., "metadata": {...}}}

`columns` is the source row as it is stored (every column of a file, under its own name; a
reasoning-gym entry's question, answer and metadata), so reward functions read what they need.

Three sources (`DataConfig.source`, dispatched on in `open_dataset`):
    reasoning_gym  reasoning-gym's procedural tasks, by name and task config.
                   `easy_arithmetic()` is a task SmolLM2-135M can already partly solve.
    local          a json / jsonl / parquet / csv file, or a `save_to_disk` folder.
    hf             `datasets.load_dataset`: a Hub dataset name or a repository folder.

`next(dataset)` hands out rows forever: each epoch visits every training row once, in an order
fixed by `seed` and the epoch number; `epoch` counts finished passes, and `state_dict()` /
`load_state_dict()` resume exactly where a run stopped. Rows held out for evaluation
(`hold_out`) are a seeded sample of the source, never in the training order.

Malformed rows (file sources) are found when the dataset is built, before any rollout: a row
whose prompt or answer is null, empty or of the wrong type raises DatasetError naming the row
and the column (`on_bad_row: raise`, the default), or, with `on_bad_row: skip`, is left out of
the order, counted in `skipped` and in one warning. Nothing is dropped silently.
"""

import hashlib
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from forge.data.rewards import ANSWER_INSTRUCTION
from forge.data.tables import DatasetError, load_table, malformed_rows, require_columns

logger = logging.getLogger(__name__)

Row = dict[str, Any]
Messages = list[dict[str, str]]

REASONING_GYM_SIZE = 10_000  # rows a reasoning-gym task generates when `size` is unset
# A reasoning-gym row's columns: what reasoning-gym's own scorer reads.
REASONING_GYM_COLUMNS = ("question", "answer", "metadata")
# Where rows come from (DataConfig.source), and what a malformed local/hf row does
# (DataConfig.on_bad_row).
Source = Literal["reasoning_gym", "local", "hf"]
OnBadRow = Literal["raise", "skip"]


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


@dataclass
class DataConfig:
    """Where an app's rows come from: the `data:` section of every app's config.

    Args:
        source: "reasoning_gym" (the procedural task `task` with options `config`), "local"
            (the file or `save_to_disk` folder at `path`) or "hf" (`datasets.load_dataset(path,
            subset, split=split)`: a Hub dataset name, or a repository folder of data files).
        task: reasoning_gym: the task ("basic_arithmetic", "chain_sum", "gsm_symbolic").
        config: reasoning_gym: the task's own options (its `*Config` fields, e.g. max_terms).
        path: local: a .json/.jsonl/.parquet/.csv file or a `save_to_disk` folder; hf: the
            dataset's name or folder.
        subset: hf: the dataset's configuration name ("main" for gsm8k), if it has several.
        split: local folders holding splits, and hf: the split to read.
        prompt_column: local/hf: a question string (put into `template`) or a list of chat
            messages ({"role", "content"} dicts, used as they are).
        answer_column: local/hf: the reference answer, a string or a number (rows carry it as a
            string).
        size: rows to use: a reasoning-gym task generates this many (None: 10,000); a file or
            dataset's first `size` rows (None: all).
        seed: fixes the held-out rows, the generated rows (reasoning_gym) and the order.
        shuffle: reorder rows each epoch.
        on_bad_row: local/hf: "raise" on a row whose prompt or answer is malformed, or "skip"
            it (counted, and named in one warning).
        cache_dir: local/hf: where `datasets` keeps its Arrow copy; None: its default.
        template: how a question string becomes chat messages.
    """

    source: Source = "reasoning_gym"
    task: str = "basic_arithmetic"
    config: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    subset: str | None = None
    split: str = "train"
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    size: int | None = None
    seed: int = 0
    shuffle: bool = True
    on_bad_row: OnBadRow = "raise"
    cache_dir: str | None = None
    template: PromptTemplate = field(default_factory=PromptTemplate)

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "reasoning_gym": "removed: a reasoning-gym task's task, config and size are keys of data",
        "local": "removed: data.source: local, with path, prompt_column and answer_column in data",
        "answer_template": "moved to target.template (the SFT app's section)",
        "completion_column": "moved to target.column (the SFT app's section)",
    }

    def __post_init__(self) -> None:
        if self.source not in get_args(Source):
            raise ValueError(f"source must be one of {get_args(Source)}, got {self.source!r}")
        if self.on_bad_row not in get_args(OnBadRow):
            raise ValueError(
                f"on_bad_row must be one of {get_args(OnBadRow)}, got {self.on_bad_row!r}"
            )
        reads_path = self.source in ("local", "hf")
        if reads_path and not self.path:
            raise ValueError(f"source {self.source} needs path")
        if not reads_path and self.path is not None:
            raise ValueError("path is read by source local or hf: set source")
        if self.subset is not None and self.source != "hf":
            raise ValueError("subset is read by source hf")
        if self.size is not None and self.size < 1:
            raise ValueError(f"size must be >= 1 (or unset for all rows), got {self.size}")


def easy_arithmetic(size: int | None = None, seed: int = 0) -> DataConfig:
    """Additions of two one-digit numbers ("Calculate 3 + 4."): a task with reward to learn from.

    SmolLM2-135M-Instruct answers one-digit additions right about 78% of the time greedily,
    while reasoning-gym's default `basic_arithmetic` (up to 6 terms of up to 4 digits, all four
    operators) gives it a sampled reward near 0.007: no signal for GRPO. As yaml:

        data:
          task: basic_arithmetic
          config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ["+"],
                   allow_parentheses: false, allow_negation: false}
    """
    return DataConfig(
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


class PromptDataset:
    """Rows in a seeded order, epoch after epoch, resumable. Subclasses implement `row`.

    Args:
        name: names the source in errors, in the start line and in the state dict.
        indices: the source indices that may be used (all rows but skipped ones).
        seed: fixes the held-out rows and the order of every epoch.
        shuffle: False visits the training rows in source order every epoch.
        hold_out: rows held out for evaluation, never in the training order: a count (int),
            or a fraction of the rows (a float in (0, 1)); 0 holds out none.
        columns: the names the rows' `columns` carry.
        skipped: source index -> why that malformed row is not among `indices`.

    Attributes:
        held_out: the held-out rows' source indices, in the seeded sample's order.
        fingerprint: a digest of which rows train and which are held out (resume checks it).
    """

    def __init__(
        self,
        name: str,
        indices: list[int],
        seed: int,
        shuffle: bool,
        hold_out: int | float = 0,
        columns: tuple[str, ...] = (),
        skipped: dict[int, str] | None = None,
    ) -> None:
        self.name = name
        self.skipped = skipped or {}
        self.seed = seed
        self.shuffle = shuffle
        self.columns = columns
        self.epoch = 0
        sample = list(indices)
        random.Random(f"forge:held_out:{seed}").shuffle(sample)
        self.held_out = sample[: _held_out_count(hold_out, len(indices), name)]
        held = set(self.held_out)
        self._indices = [i for i in indices if i not in held]
        if not self._indices:
            left = f" once {len(held)} are held out for eval" if held else ""
            raise DatasetError(f"{name}: no rows to train on{left}")
        # Equal for the same source, size, seed and hold-out; different if a file gained or
        # lost rows meanwhile.
        digest = hashlib.sha256(f"{name}|{seed}|{self.held_out}|{self._indices}".encode())
        self.fingerprint = digest.hexdigest()[:16]
        self._position = 0
        self._order = self._epoch_order(0)

    def row(self, index: int) -> Row:
        """The row at source index `index`."""
        raise NotImplementedError

    def __len__(self) -> int:
        """Training rows per epoch."""
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

    def held_out_rows(self, n: int) -> list[Row]:
        """The first `n` held-out rows (all of them if fewer)."""
        return [self.row(i) for i in self.held_out[:n]]

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands: enough for `load_state_dict` to continue from here."""
        return {
            "name": self.name,
            "rows": self.fingerprint,
            "epoch": self.epoch,
            "position": self._position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a `state_dict()` taken on the same dataset (same rows, seed and
        held-out rows).

        Raises:
            DatasetError: the state comes from other rows, so its order would differ.
        """
        self.check_same_rows(state["name"], state["rows"])
        self.epoch = state["epoch"]
        self._position = state["position"]
        self._order = self._epoch_order(self.epoch)

    def check_same_rows(self, name: str, fingerprint: str) -> None:
        """Raises DatasetError unless `fingerprint` (of `name`) is this dataset's."""
        if (name, fingerprint) != (self.name, self.fingerprint):
            raise DatasetError(
                f"cannot resume: the run read other rows ({name}, rows {fingerprint}) than "
                f"{self.name} holds now (rows {self.fingerprint}): its file changed, or its "
                "size, seed or held-out rows"
            )

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(self._indices)
        if self.shuffle:
            # String seeds hash with sha512: the same order on every platform and Python version.
            random.Random(f"forge:{self.seed}:{epoch}").shuffle(order)
        return order


def _held_out_count(hold_out: int | float, rows: int, name: str) -> int:
    if isinstance(hold_out, float):
        if not 0 < hold_out < 1:
            raise DatasetError(f"{name}: a held-out fraction must lie in (0, 1), got {hold_out}")
        return max(1, round(hold_out * rows))
    if hold_out >= rows:
        raise DatasetError(f"{name}: cannot hold out {hold_out} of its {rows} rows for eval")
    return hold_out


class ReasoningGymDataset(PromptDataset):
    """Rows from a reasoning-gym task; score them with the "reasoning_gym" reward."""

    def __init__(self, config: DataConfig, hold_out: int | float = 0) -> None:
        import reasoning_gym

        self.config = config
        size = config.size or REASONING_GYM_SIZE
        try:
            self._source = reasoning_gym.create_dataset(
                config.task, size=size, seed=config.seed, **config.config
            )
        except (ValueError, TypeError, AssertionError) as e:
            # Unknown task (ValueError), unknown option (TypeError), failed validate() (assert).
            raise DatasetError(f"reasoning-gym task {config.task!r}: {e}") from e
        name = f"reasoning_gym:{config.task}"
        super().__init__(
            name, list(range(size)), config.seed, config.shuffle, hold_out, REASONING_GYM_COLUMNS
        )

    def row(self, index: int) -> Row:
        """Row `index` of the task, generated on demand."""
        entry = self._source[index]
        return {
            "prompt": self.config.template.messages(entry["question"]),
            "question": entry["question"],
            "answer": entry["answer"],
            "task": self.config.task,
            "index": index,
            "columns": {k: entry[k] for k in REASONING_GYM_COLUMNS},
        }


class TableDataset(PromptDataset):
    """Rows of a local file or folder, or of a `datasets.load_dataset` dataset, checked row by
    row when built.

    Raises:
        DatasetError: the path cannot be loaded, a column is absent, or (with
            `on_bad_row: raise`) a row is malformed; one line naming the row and the column.
    """

    def __init__(self, config: DataConfig, hold_out: int | float = 0) -> None:
        self.config = config
        where = config.path if config.source == "local" else f"hf dataset {config.path}"
        columns = (config.prompt_column, config.answer_column)
        self._data = load_table(
            config.source, config.path, config.split, columns, config.subset, config.cache_dir
        )
        for column, key in zip(columns, ("prompt_column", "answer_column"), strict=True):
            require_columns(where, self._data.column_names, column, f"data.{key}")
        rows = min(config.size or len(self._data), len(self._data))
        malformed = _malformed(self._data, config, where, rows)
        indices = [i for i in range(rows) if i not in malformed]
        name = f"{config.source}:{config.path}"
        if config.split != "train":
            name += f"[{config.split}]"
        columns = tuple(self._data.column_names)
        super().__init__(name, indices, config.seed, config.shuffle, hold_out, columns, malformed)

    def row(self, index: int) -> Row:
        """Row `index` of the table."""
        record = dict(self._data[index])
        prompt = record[self.config.prompt_column]
        if isinstance(prompt, str):
            question, messages = prompt, self.config.template.messages(prompt)
        else:
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
            question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return {
            "prompt": messages,
            "question": question,
            "answer": str(record[self.config.answer_column]),
            "task": Path(self.config.path).stem,
            "index": index,
            "columns": record,
        }


def _malformed(table: Any, config: DataConfig, where: str, rows: int) -> dict[int, str]:
    """Row index -> what is wrong with it, for the first `rows` rows of `table`; raises on the
    first with `on_bad_row: raise`, else names the first in one warning."""
    columns = (config.prompt_column, config.answer_column)
    path = Path(config.path) if config.source == "local" else None
    malformed = malformed_rows(table, where, columns, rows, path)
    if malformed:
        first = next(iter(malformed.values()))
        if config.on_bad_row == "raise":
            more = len(malformed) - 1
            hint = f" (and {more} more malformed rows)" if more else ""
            raise DatasetError(f"{first}{hint}; data.on_bad_row: skip skips them")
        logger.warning("%s: skipping %d malformed rows; first: %s", where, len(malformed), first)
    return malformed


def open_dataset(config: DataConfig, hold_out: int | float = 0) -> PromptDataset:
    """The dataset `config` describes, with `hold_out` rows (a count, or a fraction) kept
    apart for evaluation.

    Raises:
        DatasetError: the source cannot be read, or its rows are malformed; one line.
    """
    if config.source == "reasoning_gym":
        return ReasoningGymDataset(config, hold_out)
    return TableDataset(config, hold_out)
