"""The batch record: every step's batch as the trainer consumed it, in the run folder, so that
`forge replay` (forge.loop.record.replay) can train on it again.

In an async run the nondeterminism is in which episodes make up a batch and when the weights
moved; given the batch, the step is deterministic on one machine and config. So each step
writes `run_dir/batches/step-<n>.json.gz`: its episodes per data-parallel rank (tokens, masks,
behaviour logprobs and versions, rewards, advantages, reference and teacher data), the policy
version it trained on, the trainer's figures (loss, grad norm, clip fraction, mismatch KL...),
the digest of the trained parameters before and after it, and the trainer's thread count.

    record = BatchRecord(run_dir, RecordConfig())
    record.write(step, StepRecord(...))     # whole or not at all; the oldest past last_n go
    record.read(step)                       # -> StepRecord
"""

import asyncio
import dataclasses
import gzip
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from forge.data.completion import Completion
from forge.data.episode import Episode
from forge.observability import record_metric

FOLDER = "batches"


@dataclass
class RecordConfig:
    """Which steps' batches the run folder keeps (docs/run_folder.md, "Record and replay").

    Args:
        batches: "last_n": the newest `last_n` steps; "all": every step (`forge replay --all`
            needs them); "off": none.
        last_n: how many steps "last_n" keeps: a bound on the record's size. `forge replay
            --step N` also needs a checkpoint at most `last_n` steps before N.
    """

    batches: Literal["all", "last_n", "off"] = "last_n"
    last_n: int = 32

    def __post_init__(self) -> None:
        if self.last_n < 1:
            raise ValueError(f"last_n must be >= 1, got {self.last_n}")


class RecordError(ValueError):
    """A step's record that is missing or unreadable; the message says which file and why."""


@dataclass
class StepRecord:
    """One training step as recorded.

    Args:
        step: the step (1 is the first).
        policy_version: the version of the weights it trained on (the trainer's `policy_version`).
        batches: the episodes of each data-parallel rank, in the order the trainer took them.
        params_before: digest of the trained parameters before the step.
        params_after: and after it.
        threads: the trainer's compute threads: CPU kernels may sum in another order on
            another count.
        previous_kept: whether the trainer held the weights before the previous step (the
            exact mismatch KL of one-version-old episodes needs them; a trainer just loaded
            from a checkpoint does not).
        figures: the trainer's metrics of the step, as the run logged them under train/
            (less the start and end times).
    """

    step: int
    policy_version: int | None
    batches: list[list[Episode]]
    params_before: str
    params_after: str
    threads: int
    previous_kept: bool
    figures: dict[str, float] = field(default_factory=dict)

    def episodes(self) -> list[Episode]:
        """Every rank's episodes, rank by rank."""
        return [e for rank in self.batches for e in rank]


class BatchRecord:
    """The run folder's record of batches, `run_dir/batches/step-<n>.json.gz`."""

    def __init__(self, run_dir: str | Path, cfg: RecordConfig | None = None) -> None:
        self.folder = Path(run_dir) / FOLDER
        self.cfg = cfg or RecordConfig()

    @property
    def enabled(self) -> bool:
        """Whether steps are recorded."""
        return self.cfg.batches != "off"

    def path(self, step: int) -> Path:
        """Where the record of `step` is."""
        return self.folder / f"step-{step:06d}.json.gz"

    def steps(self) -> list[int]:
        """The recorded steps, oldest first."""
        if not self.folder.is_dir():
            return []
        names = (p.name for p in self.folder.glob("step-*.json.gz"))
        return sorted(int(n.removeprefix("step-").removesuffix(".json.gz")) for n in names)

    def write(self, record: StepRecord) -> int:
        """Writes a step's record whole (a crash leaves the step recorded or not, never half),
        then drops steps past `last_n`; returns the bytes written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.path(record.step)
        tmp = target.with_name(f".{target.name}.tmp")
        data = dataclasses.asdict(record)
        for rank in data["batches"]:
            for episode in rank:  # free-form, and never read by the trainer: kept as text
                completion = episode["completion"]
                completion["metadata"] = json.loads(json.dumps(completion["metadata"], default=str))
        # Level 1: most of the saving of level 9 at a fraction of its time.
        with gzip.open(tmp, "wt", compresslevel=1) as f:
            json.dump(data, f)
        os.replace(tmp, target)
        if self.cfg.batches == "last_n":
            for old in self.steps()[: -self.cfg.last_n]:
                self.path(old).unlink(missing_ok=True)
        return target.stat().st_size

    async def write_off_loop(self, record: StepRecord) -> None:
        """`write` on a thread, its seconds and bytes recorded under record/."""
        start = time.perf_counter()
        size = await asyncio.to_thread(self.write, record)
        record_metric("record/write_s", time.perf_counter() - start)
        record_metric("record/bytes", size)

    def read(self, step: int) -> StepRecord:
        """The record of `step`.

        Raises:
            RecordError: it is not recorded, or its file cannot be read as a record.
        """
        path = self.path(step)
        try:
            with gzip.open(path, "rt") as f:
                return _from_json(json.load(f))
        except (OSError, EOFError, ValueError, TypeError, KeyError) as e:
            raise RecordError(f"{path}: cannot read the record of step {step}: {e}") from None

    def rewind(self, step: int) -> None:
        """Drops the records after `step` (a resumed run takes those steps again) and any
        write a crash left unfinished."""
        for later in (s for s in self.steps() if s > step):
            self.path(later).unlink(missing_ok=True)
        if self.folder.is_dir():
            for tmp in self.folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)


def _from_json(data: dict[str, Any]) -> StepRecord:
    batches = [[_episode(e) for e in rank] for rank in data.pop("batches")]
    return StepRecord(batches=batches, **data)


def _episode(data: dict[str, Any]) -> Episode:
    return Episode(**{**data, "completion": Completion(**data["completion"])})
