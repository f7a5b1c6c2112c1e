"""SFT data: chat rows -> (prompt, answer) token ids -> Episodes, batched by length.

Supervised fine-tuning reuses the prompt datasets (forge.data.datasets) and the trainer's input,
the Episode: the reference answer, put into `SFTTarget.template` (or a column of full answers),
becomes the assistant's target, and the Episode's completion holds its tokens, so collate()
masks the loss to answer tokens.

    examples = SFTExamples(open_dataset(DataConfig()), SFTTarget(), tokenizer)  # forever
    batches = LengthBucketBatcher(examples, batch_size=16)  # lists of similar-length rows
    episodes = [sft_episode(e, f"{step}:{i}") for i, e in enumerate(next(batches))]

Batches are right-padded, never packed (torchtitan's SDPA attention on CPU has no varlen
kernel), so LengthBucketBatcher groups rows of similar length to keep padding small.
"""

import functools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from forge.data.collate import sequences
from forge.data.completion import Completion
from forge.data.datasets import PromptDataset, Row
from forge.data.episode import Episode
from forge.data.tables import DatasetError, require_columns

if TYPE_CHECKING:  # transformers takes seconds to import; only type hints need it here
    from transformers import PreTrainedTokenizerBase

DEFAULT_ANSWER_TEMPLATE = "<answer>{answer}</answer>"

# Stands for the assistant's content when rendering the chat template to find what follows it.
_PROBE = "FORGE-SFT-PROBE-7f3a"


@dataclass
class SFTTarget:
    """What the assistant should answer: the SFT app's `target:` section.

    Args:
        template: the target text; "{answer}" is replaced by the row's reference answer (no
            other braces are interpreted). The default matches ANSWER_INSTRUCTION.
        column: a data column holding the full assistant text, used as it is instead of
            `template`; None: build the target from the answer.
    """

    template: str = DEFAULT_ANSWER_TEMPLATE
    column: str | None = None

    def __post_init__(self) -> None:
        if self.column is None and "{answer}" not in self.template:
            raise ValueError(f"template {self.template!r} has no {{answer}}")

    def check(self, source: str, columns: Sequence[str]) -> None:
        """Raises DatasetError if `columns` (of `source`) lack the target column."""
        if self.column is not None:
            require_columns(source, columns, self.column, "target.column")


@dataclass
class SFTExample:
    """One tokenized SFT row.

    Args:
        prompt_ids: the chat prompt with the generation prompt, as the generator builds it.
        answer_ids: the target text's tokens, then the chat template's end-of-turn token(s).
        text: the target text (without the end-of-turn token).
        name: the source row ("basic_arithmetic row 12": its index, from 0), its group id.
        row: the source row's index.
    """

    prompt_ids: list[int]
    answer_ids: list[int]
    text: str
    name: str
    row: int

    @property
    def length(self) -> int:
        """Tokens in the sequence the trainer sees (prompt + answer)."""
        return len(self.prompt_ids) + len(self.answer_ids)


def target_text(row: Row, target: SFTTarget) -> str:
    """The assistant's target for `row`: the template with the row's answer, or the text of
    the row's `target.column`.

    Raises:
        DatasetError: the answer (or the target column) is absent or empty; one line naming
            the row.
    """
    if target.column is None:
        what, value = "answer", row.get("answer")
    else:
        value = row.get("columns", {}).get(target.column)
        what = f"column {target.column!r}"
    text = "" if value is None else str(value)
    if not text.strip():
        problem = "is null" if value is None else f"is empty ({value!r})"
        # Counted from 1, as the dataset's own checks name rows (forge.data.tables.row_names).
        where = f"{row.get('task')} row {row['index'] + 1}"
        raise DatasetError(f"{where}: {what} {problem}; SFT needs a target text")
    return text if target.column is not None else target.template.replace("{answer}", text)


def tokenize_row(row: Row, tokenizer: "PreTrainedTokenizerBase", target: SFTTarget) -> SFTExample:
    """Tokenizes a row into the prompt the generator would send and the answer to learn.

    prompt_ids + answer_ids are the chat template applied to the prompt and the assistant's
    target, without what the template may put after the end-of-turn token (a newline): the model
    learns to stop where generation stops.

    Raises:
        DatasetError: the row has no target text (see `target_text`).
    """
    text = target_text(row, target)
    prompt_ids = tokenizer.apply_chat_template(
        row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    end_of_turn = list(_end_of_turn_ids(tokenizer))
    answer_ids = tokenizer.encode(text, add_special_tokens=False) + end_of_turn
    return SFTExample(list(prompt_ids), answer_ids, text, _row_name(row), row["index"])


@functools.lru_cache(maxsize=8)
def _end_of_turn_ids(tokenizer: "PreTrainedTokenizerBase") -> tuple[int, ...]:
    """The tokens the chat template puts after an assistant message ("<|im_end|>")."""
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    # The whitespace after the end-of-turn token separates messages; generation stops before it.
    suffix = rendered.rpartition(_PROBE)[2].rstrip()
    if not suffix:
        return (tokenizer.eos_token_id,)
    return tuple(tokenizer.encode(suffix, add_special_tokens=False))


def _row_name(row: Row) -> str:
    return f"{row.get('task')} row {row.get('index')}"


def sft_episode(example: SFTExample, episode_id: str) -> Episode:
    """An Episode whose completion is the example's answer, for collate() and the SFT loss.

    Logprobs and token versions are zeros (no policy sampled the answer); the group id is the
    source row, so two episodes of one row share it.
    """
    n = len(example.answer_ids)
    completion = Completion(
        prompt_ids=example.prompt_ids,
        token_ids=example.answer_ids,
        text=example.text,
        logprobs=[0.0] * n,
        token_versions=[0] * n,
        stop_reason="stop",
    )
    return Episode(episode_id, example.name, completion, row=example.row)


class SFTExamples:
    """Tokenized rows of a dataset, epoch after epoch in the dataset's seeded order.

    Raises:
        DatasetError: the dataset lacks `target.column`.
    """

    def __init__(
        self, dataset: PromptDataset, target: SFTTarget, tokenizer: "PreTrainedTokenizerBase"
    ) -> None:
        # Checked now, not when the first row is reached mid-training: every row has every column.
        target.check(dataset.name, dataset.columns)
        self.dataset = dataset
        self.target = target
        self.tokenizer = tokenizer

    def __iter__(self) -> "SFTExamples":
        return self

    def __next__(self) -> SFTExample:
        return tokenize_row(next(self.dataset), self.tokenizer, self.target)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's position (see PromptDataset.state_dict)."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a `state_dict()` of the same dataset."""
        self.dataset.load_state_dict(state)


class ExampleSource(Protocol):
    """An endless, resumable stream of examples (SFTExamples is one)."""

    def __next__(self) -> SFTExample: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LengthBucketBatcher:
    """Batches of `batch_size` examples of similar length, from a bounded window of the stream.

    Reads a window of `batch_size * bucket_window` examples, sorts it by length, cuts it into
    `bucket_window` batches and yields them in an order fixed by `seed` and the window number.
    Each example of the stream lands in exactly one batch; a window may straddle an epoch
    boundary of the source. `bucket_window=1` is plain sequential batching.

    Args:
        source: the examples; its state_dict is saved at each window start to resume.
        batch_size: examples per batch.
        bucket_window: batches per window: larger pads less but mixes the stream order less.
        seed: fixes the order of the batches within each window.
    """

    def __init__(
        self, source: ExampleSource, batch_size: int, bucket_window: int = 8, seed: int = 0
    ) -> None:
        if batch_size < 1 or bucket_window < 1:
            raise ValueError(
                f"batch_size and bucket_window must be >= 1, got {batch_size}, {bucket_window}"
            )
        self.source = source
        self.batch_size = batch_size
        self.bucket_window = bucket_window
        self.seed = seed
        self.window = 0
        self._batches: list[list[SFTExample]] = []
        self._emitted = 0  # batches of the current window already yielded
        self._window_state: dict[str, Any] = {}  # the source's state when the window was read

    def __iter__(self) -> Iterator[list[SFTExample]]:
        return self

    def __next__(self) -> list[SFTExample]:
        """The next batch; never stops while the source does not."""
        if not self._batches:
            self._batches = self._read_window()
        batch = self._batches[self._emitted]
        self._emitted += 1
        if self._emitted == len(self._batches):
            self.window += 1
            self._batches, self._emitted = [], 0
        return batch

    def _read_window(self) -> list[list[SFTExample]]:
        self._window_state = self.source.state_dict()
        examples = [next(self.source) for _ in range(self.batch_size * self.bucket_window)]
        examples.sort(key=lambda e: e.length)  # stable: equal lengths keep the stream's order
        size = self.batch_size
        batches = [examples[i : i + size] for i in range(0, len(examples), size)]
        # Otherwise every window would run from short to long batches.
        random.Random(f"forge:sft:{self.seed}:{self.window}").shuffle(batches)
        return batches

    def state_dict(self) -> dict[str, Any]:
        """Where batching stands: the source's state at the current window's start, and how
        many of its batches were yielded (resuming re-reads the window and skips those)."""
        window_read = bool(self._batches)
        return {
            "source": self._window_state if window_read else self.source.state_dict(),
            "window": self.window,
            "emitted": self._emitted,
            "batch_size": self.batch_size,
            "bucket_window": self.bucket_window,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a `state_dict()` of a batcher with the same settings and source.

        Raises:
            DatasetError: the state comes from other settings, so its batches would differ.
        """
        mine = (self.batch_size, self.bucket_window, self.seed)
        theirs = (state["batch_size"], state["bucket_window"], state["seed"])
        if mine != theirs:
            raise DatasetError(
                f"cannot resume: state is for (batch_size, bucket_window, seed) = {theirs}, "
                f"this batcher is {mine}"
            )
        self.source.load_state_dict(state["source"])
        self.window, self._emitted, self._batches = state["window"], state["emitted"], []


def padding_fraction(episodes: list[Episode]) -> float:
    """Pad tokens / all tokens of the batch collate() builds from `episodes` (right-padded)."""
    lengths = [len(prompt) + len(completion) for prompt, completion in sequences(episodes)]
    total = len(lengths) * max(lengths)
    return (total - sum(lengths)) / total
