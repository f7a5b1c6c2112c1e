"""`forge replay`: a run's training steps taken again from its batch record (batches.py),
compared figure by figure with what the run recorded.

    forge replay RUN --step N [trainer.loss.clip_eps=0.1 ...]
    forge replay RUN --all

`--step N` starts a trainer alone (the run's trainer resources, no generator), loads the newest
checkpoint it can start from (step 0: the weights the run started with), trains on the recorded
batches up to N-1, then takes step N and prints its figures beside the recorded ones. `--all`
re-trains the whole run from step 0 and ends by comparing with its final checkpoint. On the
same machine type, library versions and thread counts, every figure and the parameters' digest
match bit for bit. Overrides of the trainer's loss, optimizer, schedule, gradient clipping or
divergence guard make a what-if: the steps before are replayed as recorded, the compared steps
under the new settings. Exit status (`forge replay`): 0 the replay matches the record, 1 a
figure differs, 2 bad input, 3 the replay itself failed.
"""

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from forge.actors.trainer import TitanTrainer, TrainerConfig
from forge.actors.trainer.checkpoint_folder import complete_steps, latest_step, step_folder
from forge.actors.trainer.config import OPTIMISATION_FIELDS
from forge.config import ConfigError, load_config
from forge.controller import init_provisioner, shutdown
from forge.loop.config import RunConfig
from forge.loop.live_settings import ControlRecord
from forge.loop.record.batches import BatchRecord, RecordError, StepRecord
from forge.loop.run_folder import CONFIG
from forge.loop.spawn import spawn_role
from forge.loop.trainer_handle import TrainerHandle
from forge.observability.console import say
from forge.placement.roles import Role

# The figures a replay compares, in the table's order (those the objective reports); the
# parameters' digest comes last.
FIGURES = (
    "loss", "grad_norm", "skipped", "clip_frac", "ratio_mean", "reverse_kl", "mismatch_kl",
    "policy_drift_kl", "current_token_fraction", "mismatch_previous_sampled",
)  # fmt: skip
# The exact mismatch KL's figures: they read the weights before the previous step.
MISMATCH = ("mismatch_kl", "mismatch_previous_sampled")


class ReplayError(ConfigError):
    """A replay that cannot start or go on (no such run or step, a step no longer recorded or
    unreadable, a key a what-if cannot change); one line says which."""


@dataclass
class ReplaySteps:
    """What a replay does: load checkpoint `start`, train steps start+1..end, compare from
    `compare_from` on."""

    start: int
    end: int
    compare_from: int


def load_run(run_dir: Path, what_if: Sequence[str] = ()) -> RunConfig:
    """The run's config as saved in its folder (the fields every app shares), with the what-if
    overrides applied.

    Raises:
        ReplayError: no run in `run_dir`, or an override of a key that shapes the batch.
    """
    saved = run_dir / CONFIG
    if not saved.is_file():
        raise ReplayError(f"{run_dir}: no run here (no {CONFIG})")
    allowed = tuple(f"trainer.{name}" for name in OPTIMISATION_FIELDS)
    for override in what_if:
        key = override.partition("=")[0]
        if not key.startswith(allowed):
            raise ReplayError(
                f"{key}: a replay trains the recorded batches as the run did (the model, data "
                f"and sampling that made them, the trainer's shape); a what-if may change "
                f"{', '.join(allowed)}"
            )
    return load_config(RunConfig, saved, what_if, known_only=True)


def checkpoint_folder(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The run's checkpoint folder. One inside the run folder, given relative to where the run
    was started (`${run_dir}/checkpoints`), is found from `run_dir` wherever the replay runs."""
    folder = cfg.trainer.checkpoint.folder
    if folder is None:
        return None
    path, saved_run_dir = Path(folder), Path(cfg.run_dir)
    if not path.is_absolute() and path.is_relative_to(saved_run_dir):
        return run_dir / path.relative_to(saved_run_dir)
    return path


def replay_steps(record: BatchRecord, checkpoints: Path | None, step: int | None) -> ReplaySteps:
    """Where a replay of `step` (None: the whole run) starts: the newest checkpoint at most
    step-1 (step 0: the starting weights) from which every step up to `step` is recorded.

    Raises:
        ReplayError: the step is not recorded, or no start leads to it.
    """
    recorded = record.steps()
    if not recorded:
        raise ReplayError(f"{record.folder.parent}: no recorded batches (record.batches: off?)")
    end = step if step is not None else recorded[-1]
    if end not in recorded:
        raise ReplayError(
            f"step {end} is not recorded in {record.folder} (recorded: {_spans(recorded)})"
        )
    starts = [0] if step is None else _starts(checkpoints, end)
    usable = [s for s in starts if set(range(s + 1, end + 1)) <= set(recorded)]
    if not usable:
        raise ReplayError(
            f"step {end}: no checkpoint before it from which every step is recorded (recorded: "
            f"{_spans(recorded)}; checkpoints: {starts}); record.batches=all keeps every step"
        )
    start = usable[-1]
    # The exact mismatch KL of step `end` reads the weights before step end-1, which a trainer
    # just loaded from checkpoint end-1 lacks: start one checkpoint earlier if there is one.
    if start == end - 1 and len(usable) > 1 and read(record, end).previous_kept:
        start = usable[-2]
    return ReplaySteps(start, end, compare_from=1 if step is None else end)


def how_to_replay(record: BatchRecord, checkpoints: Path | None, step: int) -> str:
    """The command that replays `step` of the run `record` belongs to, or why there is none."""
    if not record.enabled:
        return "record.batches is off: it cannot be replayed"
    try:
        replay_steps(record, checkpoints, step)
    except ReplayError as e:
        return f"it cannot be replayed: {e}"
    return f"replay it: forge replay {record.folder.parent} --step {step}"


def read(record: BatchRecord, step: int) -> StepRecord:
    """`record.read(step)`, its failure a ReplayError."""
    try:
        return record.read(step)
    except RecordError as e:
        raise ReplayError(str(e)) from None


def _starts(checkpoints: Path | None, end: int) -> list[int]:
    """Step 0 and every complete checkpoint before `end`, oldest first."""
    if checkpoints is None or not checkpoints.is_dir():
        return [0]
    return [0, *(s for s in complete_steps(checkpoints) if s < end)]


def _spans(steps: list[int]) -> str:
    whole = steps == list(range(steps[0], steps[-1] + 1))
    return f"{steps[0]}..{steps[-1]}" if whole else str(steps)


@dataclass
class Replay:
    """A replay, checked and ready to run: `Replay.prepare(...)`, then `await replay.run()`."""

    run_dir: Path
    cfg: RunConfig  # the run's
    record: BatchRecord
    checkpoints: Path | None
    steps: ReplaySteps
    what_if: tuple[str, ...]
    whole_run: bool

    @property
    def world(self) -> int:
        """The trainer's data-parallel ranks."""
        return self.cfg.trainer_ranks

    @classmethod
    def prepare(
        cls, run_dir: str | Path, step: int | None, what_if: Sequence[str] = ()
    ) -> "Replay":
        """A replay of `step` (None: every step) of the run in `run_dir`, under `what_if`.

        Raises:
            ReplayError: bad input (see `load_run` and `replay_steps`).
        """
        run_dir = Path(run_dir)
        load_run(run_dir, what_if)  # a what-if of another key is refused before anything starts
        cfg = load_run(run_dir)
        record = BatchRecord(run_dir)
        checkpoints = checkpoint_folder(cfg, run_dir)
        steps = replay_steps(record, checkpoints, step)
        return cls(run_dir, cfg, record, checkpoints, steps, tuple(what_if), step is None)

    def settings_at(self, step: int) -> TrainerConfig:
        """The trainer's settings for `step`: the run's, as changed live up to it
        (control.jsonl), and the what-if's from `compare_from` on."""
        what_if = self.what_if if step >= self.steps.compare_from else ()
        cfg = load_run(self.run_dir, what_if)
        overridden = [o.partition("=")[0] for o in what_if]
        ControlRecord(self.run_dir).apply(cfg, up_to=step, keep=overridden, under="trainer.")
        return _trainer_config(cfg)

    async def run(self) -> int:
        """Replays the steps; returns the exit status: 0 the replay matches the record, 1 a
        figure (or the parameters) differs."""
        p, checkpoints = self.steps, self.checkpoints
        say(_header(self.run_dir, p, self.what_if))
        init_provisioner(self.cfg.provisioner)
        try:
            trainer = await _spawn_trainer(self.cfg)
            if p.start:
                await trainer.load_checkpoint(str(checkpoints), p.start)
            # A checkpoint restores the learning rate it was taken under, not the loss's
            # settings: with live changes, the first step sets them all.
            held = None if ControlRecord(self.run_dir).changes() else self.settings_at(p.start)
            column = "what-if" if self.what_if else "replayed"
            same = await _train(
                trainer, self.record, p, (self.settings_at, held), self.world, column
            )
            if self.whole_run and checkpoints is not None and latest_step(checkpoints) == p.end:
                same = await _matches_final_checkpoint(trainer, checkpoints, p.end) and same
        finally:
            await shutdown()
        return 0 if same else 1


def _header(run_dir: Path, p: ReplaySteps, what_if: Sequence[str]) -> str:
    start = f"checkpoint step-{p.start}" if p.start else "the run's starting weights"
    changed = f" | what-if: {' '.join(what_if)}" if what_if else ""
    return f"forge replay {run_dir}: from {start}, steps {p.start + 1}..{p.end}{changed}"


def _trainer_config(cfg: RunConfig) -> TrainerConfig:
    """The run's trainer section for a replay's trainer, which neither resumes nor writes
    checkpoints."""
    no_folder = dataclasses.replace(cfg.trainer.checkpoint, folder=None)
    return dataclasses.replace(cfg.trainer, checkpoint=no_folder)


async def _spawn_trainer(cfg: RunConfig) -> TrainerHandle:
    """The run's trainer alone, as recorded (a what-if comes later)."""
    args = (_trainer_config(cfg), cfg.weight_sync)
    return TrainerHandle(
        await spawn_role(Role("trainer", TitanTrainer, args, cfg.trainer_resources))
    )


async def _train(
    trainer: TrainerHandle,
    record: BatchRecord,
    p: ReplaySteps,
    settings: tuple[Callable[[int], TrainerConfig], TrainerConfig | None],
    world: int,
    column: str,
) -> bool:
    """Steps start+1..end on their recorded batches, each under the settings in force at it
    (`settings`: those of a step, and those the trainer holds); compares each from
    `compare_from` on. Returns whether every compared step matched."""
    same, threads = True, 0
    settings_at, held = settings
    for s in range(p.start + 1, p.end + 1):
        recorded = read(record, s)
        if (wanted := settings_at(s)) != held:
            await trainer.set_optimisation(wanted)
            held = wanted
        if recorded.threads != threads:
            threads = recorded.threads
            await _use_threads(trainer, threads, world)
        got = await trainer.train_step(recorded.batches, recorded.policy_version, record=True)
        if s == p.start + 1 and got["record"]["params_before"] != recorded.params_before:
            say(f"step {s}: the replay starts from other parameters than the run did")
            return False  # the checkpoint (or the model it started from) is not the run's
        if s < p.compare_from:
            say(f"step {s}: taken as recorded (parameters {_same(recorded, got)})")
            continue
        # The exact mismatch KL reads the weights before the previous step, which a trainer
        # just loaded from a checkpoint lacks: comparable only where both held them or neither.
        skip = MISMATCH if got["record"]["previous_kept"] != recorded.previous_kept else ()
        diff = _differences(recorded, got, skip)
        same = same and not diff
        if s == p.end or diff:
            say(_table(recorded, got, skip, column))
        say(_verdict(s, diff))
    return same


async def _use_threads(trainer: TrainerHandle, threads: int, world: int) -> None:
    """Each of the `world` trainer ranks on `threads` compute threads, as recorded (CPU kernels
    may sum in another order on another count), and on as many cores of this machine where it
    has them (threads sharing a core slow a step many times over)."""
    cores = sorted(os.sched_getaffinity(0))
    await trainer.use_cores(cores[: threads * world] if len(cores) >= threads * world else cores)
    await trainer.use_threads(threads)


def _same(recorded: StepRecord, got: dict) -> str:
    return "match" if got["record"]["params_after"] == recorded.params_after else "differ"


def _differences(recorded: StepRecord, got: dict, skip: Sequence[str]) -> list[str]:
    """The figures (and "params") in which the replayed step differs from the recorded one."""
    names = [n for n in FIGURES if n in recorded.figures and n not in skip]
    diff = [n for n in names if not _equal(recorded.figures[n], got.get(n))]
    if got["record"]["params_after"] != recorded.params_after:
        diff.append("params")
    return diff


def _equal(a: float, b: float | None) -> bool:
    return b is not None and (a == b or (a != a and b != b))  # NaN matches NaN


def _table(recorded: StepRecord, got: dict, skip: Sequence[str], column: str) -> str:
    rows = [("figure", "recorded", column)]
    for name in (n for n in FIGURES if n in recorded.figures):
        if name in skip:
            shown = "n/a: one trainer lacked the previous weights"
        else:
            shown = repr(got.get(name))
        rows.append((name, repr(recorded.figures[name]), shown))
    rows.append(("params digest", recorded.params_after, got["record"]["params_after"]))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows)


def _verdict(step: int, diff: list[str]) -> str:
    if not diff:
        return f"step {step}: replayed bit-exactly (every figure and the parameters match)"
    return f"step {step}: differs from the record in {', '.join(diff)}"


async def _matches_final_checkpoint(trainer: TrainerHandle, checkpoints: Path, end: int) -> bool:
    """Whether the replayed parameters are the final checkpoint's, bit for bit."""
    replayed = await trainer.params_digest()
    await trainer.load_checkpoint(str(checkpoints), end)
    final = await trainer.params_digest()
    same = replayed == final
    verdict = "the same parameters" if same else f"other parameters ({replayed} vs {final})"
    say(f"after step {end}: {verdict} as the final checkpoint, {step_folder(checkpoints, end)}")
    return same
