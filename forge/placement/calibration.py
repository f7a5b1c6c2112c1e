"""Calibration: the cost model's phase costs, measured on this machine with the run's own
processes, and cached per machine, model and workload.

With generator and trainer colocated on `n` cores, for each core count c the cost model may
use (`core_counts`): the generator is moved onto c cores and makes one batch of rollouts (the
run's prompts and sampling, seeds of their own; thrown away after), and the trainer, moved
onto c cores, times a few micro-batches of that batch forward and backward
(`TitanTrainer.calibrate`, scaled to the whole batch). The weight sync is the fastest of a few
real ones, to a scratch version of the same weights and back. It costs a batch of rollouts
and a few training micro-batches per core count, so it runs once per machine and workload and
is cached.

Noise must not decide: a measurement during which other work took the run's cores
(forge.placement.load), or that came out slower on more cores than on fewer, is refused and
taken again; where colocated and the fastest split come out within the spread of each other,
or a measurement was refused, their measurements are taken again in the opposite order, so a
disturbance that lasts a while falls on both. Each cost is the fastest measurement kept (a
disturbance only slows), and the spread of the repeated ones goes with the costs: a split has
to win by more than it (cost_model.decide). A calibration that had to keep a disturbed
measurement is not cached.

What it measures comes in through narrow arguments: two processes it can move (`Movable`)
and the run's work (`Workload`), never the run itself.
"""

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from forge.cache import cache_root
from forge.placement.cost_model import MIN_SPREAD, Decision, PhaseCosts
from forge.placement.load import Reading, disturbance

# Seeds for calibration rollouts, far from the run's (seed * 1_000_003 + group * G).
SEED_BASE = 2**40
# How often one measurement is taken before a refused one is kept (and said).
MAX_TRIES = 3

# What one measurement times: generation one phase, the trainer's passes two.
Kind = Literal["generate", "train"]
PHASES: dict[Kind, tuple[str, ...]] = {"generate": ("generate_s",), "train": ("train_s", "stale_s")}
WHAT: dict[Kind, str] = {"generate": "generation", "train": "training"}


def core_counts(n: int) -> list[int]:
    """The core counts to measure on `n` cores: all of them, and each side of the splits the
    model considers (1, a quarter, half, three quarters, all but one)."""
    return sorted({n, *(c for c in (1, n // 4, n // 2, n - n // 4, n - 1) if 1 <= c < n)})


def cache_path() -> Path:
    """`$FORGE_CACHE/calibration.json` (default `~/.cache/forge`)."""
    return cache_root() / "calibration.json"


def cache_key(workload: tuple[Hashable, ...], cores: int) -> str:
    """What the costs depend on: the machine, its cores, the code, and `workload` (the models
    and the shape of a step: `RLConfig.workload()`)."""
    return "|".join(map(str, (_cpu_model(), cores, code_version(), *workload)))


@functools.cache
def code_version() -> str:
    """A digest of forge's own source and the versions of torch and vLLM: a change to any of
    them may change what a phase costs, so costs cached before it are not reused."""
    digest = hashlib.sha256(f"{_version('torch')}|{_version('vllm')}".encode())
    root = Path(__file__).parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def load(key: str) -> PhaseCosts | None:
    """The cached costs under `key`, if any."""
    entry = _read().get(key)
    if entry is None:
        return None
    return PhaseCosts(
        generate_s=_int_keys(entry["generate_s"]),
        train_s=_int_keys(entry["train_s"]),
        stale_s=_int_keys(entry["stale_s"]),
        sync_s=entry["sync_s"],
        spread=entry["spread"],
    )


def save(key: str, costs: PhaseCosts) -> None:
    """Caches `costs` under `key`."""
    cache = _read()
    cache[key] = {**vars(costs), "measured": time.strftime("%Y-%m-%d %H:%M")}
    _write(cache)


def forget(key: str) -> None:
    """Drops the costs cached under `key`, if any: the next run that needs them measures."""
    cache = _read()
    if cache.pop(key, None) is not None:
        _write(cache)


def _write(cache: dict) -> None:
    """Written whole, then renamed: readers never see half a cache."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1) + "\n")
    tmp.replace(path)


class Movable(Protocol):
    """A process calibration moves between core counts (a generator, a trainer)."""

    async def use_cores(self, cpus: list[int]) -> Any: ...


@dataclass(frozen=True)
class Workload:
    """What calibration runs and times, as the run provides it.

    Args:
        rollouts: `rollouts(groups, seed_base)`: that many groups (None: one batch) of the
            run's rollouts, generated and scored, group k with seed `seed_base + k * G`.
        train_costs: one batch's episodes in, the trainer's timed passes on them out
            ({"train_s", "stale_s"}: TitanTrainer.calibrate).
        sync_away: publishes a scratch version of the same weights and moves every generator
            to it.
        sync_back: moves every generator back to the run's own version (deleting the
            scratch one).
        forget_records: drops the metrics the calibration recorded (they belong to no step).
        read_load: the machine's load on the cores given (forge.placement.load.read), read
            around each measurement; None where generator and trainer are not this
            process's descendants on this machine, so their work cannot be told from others'.
    """

    rollouts: Callable[[int | None, int], Awaitable[list]]
    train_costs: Callable[[list], Awaitable[dict[str, float]]]
    sync_away: Callable[[], Awaitable[None]]
    sync_back: Callable[[], Awaitable[None]]
    forget_records: Callable[[], Awaitable[None]]
    read_load: Callable[[list[int]], Reading] | None = None


@dataclass
class Samples:
    """The measurements a calibration kept, by kind and core count, in the order taken."""

    taken: dict[tuple[Kind, int], list[dict[str, float]]] = field(default_factory=dict)

    def add(self, kind: Kind, cores: int, measured: dict[str, float]) -> None:
        """Keeps a measurement of `kind` on `cores` cores ({phase: seconds})."""
        self.taken.setdefault((kind, cores), []).append(measured)

    def drop_slowest(self, kind: Kind, cores: int) -> None:
        """Refuses the slowest measurement of `kind` on `cores` cores."""
        kept = self.taken[(kind, cores)]
        kept.remove(max(kept, key=lambda m: m[PHASES[kind][0]]))

    def fastest(self, kind: Kind) -> dict[int, float]:
        """Each core count's fastest measurement of `kind`'s main phase."""
        main = PHASES[kind][0]
        return {c: min(m[main] for m in ms) for (k, c), ms in self.taken.items() if k == kind}

    def spread(self) -> float:
        """The largest (slowest - fastest) / fastest of one kind on one core count."""
        spreads = [
            (max(times) - min(times)) / min(times)
            for (kind, _), ms in self.taken.items()
            if len(times := [m[PHASES[kind][0]] for m in ms]) > 1 and min(times) > 0
        ]
        return max(spreads, default=0.0)

    def slower_with_more_cores(self) -> list[tuple[Kind, int]]:
        """The measurements slower on their core count than on fewer, by more than
        MIN_SPREAD: a disturbance, since a phase given more cores is not that much slower."""
        suspects: list[tuple[Kind, int]] = []
        for kind in PHASES:
            fastest = self.fastest(kind)
            counts = sorted(fastest)
            suspects += [
                (kind, c)
                for i, c in enumerate(counts)
                if i and fastest[c] > min(fastest[d] for d in counts[:i]) * (1 + MIN_SPREAD)
            ]
        return suspects

    def costs(self, sync_s: float) -> PhaseCosts:
        """The fastest measurement of each phase on each core count: a disturbance only
        slows."""
        per_phase = {
            phase: {c: min(m[phase] for m in ms) for (k, c), ms in self.taken.items() if k == kind}
            for kind, phases in PHASES.items()
            for phase in phases
        }
        return PhaseCosts(**per_phase, sync_s=sync_s, spread=self.spread())


@dataclass(frozen=True)
class Measured:
    """A calibration's costs, and whether it had to keep a disturbed measurement (then they
    are not cached: the next run measures again)."""

    costs: PhaseCosts
    disturbed: bool


async def measure(
    generator: Movable,
    trainer: Movable,
    work: Workload,
    cpus: list[int],
    decide: Callable[[PhaseCosts], Decision],
    say: Callable[[str], None],
    clock: Callable[[], float] = time.perf_counter,
) -> Measured:
    """Measures the phase costs with the run's generator and trainer, which must both hold
    `cpus`; leaves them both on all of `cpus`. `decide` tells colocated from the fastest
    split on the costs so far (cost_model.decide); `say` tells the user what was measured
    again and why; `clock` times generation."""
    calibrating = _Calibrating(generator, trainer, work, cpus, say, clock)
    await work.rollouts(1, SEED_BASE)  # untimed: an engine's first requests run slowly
    sync_s = await _sync_s(work, clock)  # first: the decisions below weigh it
    counts = list(reversed(core_counts(len(cpus))))  # all cores first: the trainer's batch
    await calibrating.round([*(("generate", c) for c in counts), *(("train", c) for c in counts)])
    decision = decide(calibrating.samples.costs(sync_s))
    if decision.close or calibrating.refused:
        await calibrating.round(_again(decision))
    await generator.use_cores(cpus)
    await trainer.use_cores(cpus)
    return Measured(calibrating.samples.costs(sync_s), calibrating.disturbed)


def _again(decision: Decision) -> list[tuple[Kind, int]]:
    """What the two candidates rest on, to measure again in the opposite order of the first
    round (fewer cores first): generation then training, the split's before colocated's."""
    n = decision.colocated.generator_cores
    split = decision.split
    generate = [split.generator_cores, n] if split else [n]
    train = [split.trainer_cores, n] if split else [n]
    return [*(("generate", c) for c in generate), *(("train", c) for c in train)]


class _Calibrating:
    """One calibration under way: the processes it moves, the measurements it kept."""

    def __init__(
        self,
        generator: Movable,
        trainer: Movable,
        work: Workload,
        cpus: list[int],
        say: Callable[[str], None],
        clock: Callable[[], float],
    ) -> None:
        self.generator, self.trainer, self.work, self.cpus = generator, trainer, work, cpus
        self.say, self.clock = say, clock
        self.samples = Samples()
        self.episodes: list = []  # the first batch on all cores: what the trainer times
        self.refused = 0  # measurements refused: disturbed, or slower on more cores
        self.disturbed = False  # a measurement was kept disturbed, after MAX_TRIES
        self.slower: set[tuple[Kind, int]] = set()  # kept slower on more cores than on fewer

    async def round(self, order: list[tuple[Kind, int]]) -> None:
        """Measures each of `order`, then takes again any slower on more cores than on fewer."""
        for kind, cores in order:
            await self.take(kind, cores)
        await self.retake_slower()

    async def take(self, kind: Kind, cores: int) -> None:
        """One measurement of `kind` on `cores` cores, taken again while other work shared
        the cores, up to MAX_TRIES; then the fastest of the tries is kept."""
        tries = []
        for _ in range(MAX_TRIES):
            before = self._read()
            measured = await self._once(kind, cores)
            why = None if before is None else disturbance(before, self._read())
            if why is None:
                self.samples.add(kind, cores, measured)
                return
            tries.append(measured)
            self.refused += 1
            self.say(f"calibration: {WHAT[kind]} on {cores} cores disturbed ({why})")
        self.disturbed = True
        self.samples.add(kind, cores, min(tries, key=lambda m: m[PHASES[kind][0]]))
        self.say(
            f"calibration: {WHAT[kind]} on {cores} cores kept after {MAX_TRIES} disturbed "
            "measurements; these costs will not be cached"
        )

    async def retake_slower(self) -> None:
        """Takes again what came out slower on more cores than on fewer, refusing the slower
        of the two measurements, up to MAX_TRIES measurements in all; what stays slower is
        this machine's (a model too small for more threads to help) and is kept."""
        for _ in range(MAX_TRIES - 1):
            suspects = [s for s in self.samples.slower_with_more_cores() if s not in self.slower]
            if not suspects:
                return
            for kind, cores in suspects:
                self.say(
                    f"calibration: {WHAT[kind]} on {cores} cores came out slower than on "
                    "fewer: measured again"
                )
                self.refused += 1
                await self.take(kind, cores)
                self.samples.drop_slowest(kind, cores)
        for kind, cores in self.samples.slower_with_more_cores():
            if (kind, cores) not in self.slower:
                self.slower.add((kind, cores))
                self.say(f"calibration: {WHAT[kind]} on {cores} cores stays slower than on fewer")

    async def _once(self, kind: Kind, cores: int) -> dict[str, float]:
        """One measurement of `kind`, its process moved onto the first `cores` cores."""
        if kind == "generate":
            await self.generator.use_cores(self.cpus[:cores])
            start = self.clock()
            batch = await self.work.rollouts(None, SEED_BASE)
            self.episodes = self.episodes or batch
            return {"generate_s": self.clock() - start}
        await self.trainer.use_cores(self.cpus[:cores])
        costs = await self.work.train_costs(self.episodes)
        return {"train_s": costs["train_s"], "stale_s": costs["stale_s"]}

    def _read(self) -> Reading | None:
        return None if self.work.read_load is None else self.work.read_load(self.cpus)


async def _sync_s(work: Workload, clock: Callable[[], float]) -> float:
    """The fastest of four real syncs: to a scratch version of the same weights and back to the
    run's own (which deletes the scratch one), twice. A run's first syncs also fill its buffers:
    the second was already as fast as the steady state in float32, the third in bfloat16."""
    times = []
    for _ in range(2):
        for sync in (work.sync_away, work.sync_back):
            start = clock()
            await sync()
            times.append(clock() - start)
    return min(times)


def _read() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _int_keys(d: dict) -> dict[int, float]:
    return {int(k): float(v) for k, v in d.items()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
