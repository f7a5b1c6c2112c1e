"""SFT data: chat rows -> (prompt, answer) token ids -> Episodes, batched by length.

Supervised fine-tuning reuses the prompt datasets (forge.data.datasets) and the trainer's input,
the Episode: the reference answer, put into `answer_template`, becomes the assistant's target,
and the Episode's completion holds its tokens, so collate() masks the loss to answer tokens.

    examples = SFTExamples(SFTDatasetConfig(), tokenizer)     # tokenized rows, forever
    batches = LengthBucketBatcher(examples, batch_size=16)    # lists of similar-length rows
    episodes = [sft_episode(e, f"{step}:{i}") for i, e in enumerate(next(batches))]

Batches are right-padded, never packed (torchtitan's SDPA attention on CPU has no varlen
kernel), so LengthBucketBatcher groups rows of similar length to keep padding small.
"""

import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from forge.data.collate import sequences
from forge.data.completion import Completion
from forge.data.datasets import (
    DatasetError,
    LocalDataset,
    LocalDatasetConfig,
    PromptDataset,
    ReasoningGymConfig,
    ReasoningGymDataset,
    Row,
    easy_arithmetic,
)
from forge.data.episode import Episode

if TYPE_CHECKING:  # transformers takes seconds to import; only type hints need it here
    from transformers import PreTrainedTokenizerBase

DEFAULT_ANSWER_TEMPLATE = "<answer>{answer}</answer>"

# Stands for the assistant's content when rendering the chat template to find what follows it.
_PROBE = "FORGE-SFT-PROBE-7f3a"


@dataclass
class SFTDatasetConfig:
    """Where SFT rows come from and what the assistant should answer.

    Args:
        source: "reasoning_gym" (use `reasoning_gym`) or "local" (use `local`).
        reasoning_gym: the reasoning-gym task, when source is "reasoning_gym".
        local: the local file or folder, when source is "local".
        answer_template: the target text; "{answer}" is replaced by the row's reference answer
            (no other braces are interpreted). The default matches ANSWER_INSTRUCTION.
        completion_column: a local column holding the full assistant text, used as it is
            instead of `answer_template`; None: build the target from the answer.
    """

    source: Literal["reasoning_gym", "local"] = "reasoning_gym"
    reasoning_gym: ReasoningGymConfig = field(default_factory=easy_arithmetic)
    local: LocalDatasetConfig | None = None
    answer_template: str = DEFAULT_ANSWER_TEMPLATE
    completion_column: str | None = None

    def __post_init__(self) -> None:
        if self.source not in ("reasoning_gym", "local"):
            raise ValueError(f"source must be 'reasoning_gym' or 'local', got {self.source!r}")
        if self.source == "local" and self.local is None:
            raise ValueError("source 'local' needs local.path")
        if self.completion_column is not None:
            if self.source != "local":
                raise ValueError("completion_column needs source 'local'")
            if self.completion_column == self.local.answer_column:
                # LocalDataset reads that column as the answer: the template does the job.
                raise ValueError(
                    "completion_column is local.answer_column: leave it unset and set "
                    "answer_template to '{answer}'"
                )
        elif "{answer}" not in self.answer_template:
            raise ValueError(f"answer_template {self.answer_template!r} has no {{answer}}")


@dataclass
class SFTExample:
    """One tokenized SFT row.

    Args:
        prompt_ids: the chat prompt with the generation prompt, as the generator builds it.
        answer_ids: the target text's tokens, then the chat template's end-of-turn token(s).
        text: the target text (without the end-of-turn token).
        name: the source row ("basic_arithmetic row 12"), for errors and group ids.
    """

    prompt_ids: list[int]
    answer_ids: list[int]
    text: str
    name: str

    @property
    def length(self) -> int:
        """Tokens in the sequence the trainer sees (prompt + answer)."""
        return len(self.prompt_ids) + len(self.answer_ids)


def target_text(
    row: Row, template: str = DEFAULT_ANSWER_TEMPLATE, completion_column: str | None = None
) -> str:
    """The assistant's target for `row`: `template` with the row's answer, or the completion.

    Args:
        row: a forge.data.datasets row.
        template: "{answer}" is replaced by `row["answer"]`.
        completion_column: read the full target from this column (LocalDataset keeps extra
            columns in `row["metadata"]`) instead of filling the template.

    Raises:
        DatasetError: the answer (or completion) is absent or empty; one line naming the row.
    """
    if completion_column is None:
        what, value = "answer", row.get("answer")
    else:
        value = row.get("metadata", {}).get(completion_column)
        what = f"column {completion_column!r}"
    text = "" if value is None else str(value)
    if not text.strip():
        problem = "is null" if value is None else f"is empty ({value!r})"
        raise DatasetError(f"{_row_name(row)}: {what} {problem}; SFT needs a target text")
    return text if completion_column is not None else template.replace("{answer}", text)


def tokenize_row(
    row: Row,
    tokenizer: "PreTrainedTokenizerBase",
    template: str = DEFAULT_ANSWER_TEMPLATE,
    *,
    completion_column: str | None = None,
) -> SFTExample:
    """Tokenizes a row into the prompt the generator would send and the answer to learn.

    prompt_ids + answer_ids are the chat template applied to the prompt and the assistant's
    target, without what the template may put after the end-of-turn token (a newline): the model
    learns to stop where generation stops.

    Raises:
        DatasetError: the row has no target text (see `target_text`).
    """
    text = target_text(row, template, completion_column)
    prompt_ids = tokenizer.apply_chat_template(
        row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    end_of_turn = list(_end_of_turn_ids(tokenizer))
    answer_ids = tokenizer.encode(text, add_special_tokens=False) + end_of_turn
    return SFTExample(list(prompt_ids), answer_ids, text, _row_name(row))


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
    return Episode(episode_id=episode_id, group_id=example.name, completion=completion)


class SFTExamples:
    """Tokenized rows of an SFT dataset, epoch after epoch in the dataset's seeded order.

    Raises:
        DatasetError: the dataset cannot be built, or lacks `completion_column`.
    """

    def __init__(self, config: SFTDatasetConfig, tokenizer: "PreTrainedTokenizerBase") -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.dataset = _dataset(config)

    def __iter__(self) -> "SFTExamples":
        return self

    def __next__(self) -> SFTExample:
        row = next(self.dataset)
        return tokenize_row(
            row,
            self.tokenizer,
            self.config.answer_template,
            completion_column=self.config.completion_column,
        )

    def state_dict(self) -> dict[str, Any]:
        """The dataset's position (see PromptDataset.state_dict)."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a `state_dict()` of the same dataset."""
        self.dataset.load_state_dict(state)


def _dataset(config: SFTDatasetConfig) -> PromptDataset:
    if config.source == "reasoning_gym":
        return ReasoningGymDataset(config.reasoning_gym)
    dataset = LocalDataset(config.local)
    column = config.completion_column
    # Checked now, not when the first row is reached mid-training: every row has every column.
    others = dataset.nth(0)["metadata"]
    if column is not None and column not in others:
        raise DatasetError(
            f"{config.local.path}: no column {column!r} (other columns: "
            f"{', '.join(others) or 'none'}); set completion_column"
        )
    return dataset


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
