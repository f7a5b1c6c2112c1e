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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from forge.cache import cache_root
from forge.placement.cost_model import PhaseCosts

# Seeds for calibration rollouts, far from the run's (seed * 1_000_003 + group * G).
SEED_BASE = 2**40


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
    """

    rollouts: Callable[[int | None, int], Awaitable[list]]
    train_costs: Callable[[list], Awaitable[dict[str, float]]]
    sync_away: Callable[[], Awaitable[None]]
    sync_back: Callable[[], Awaitable[None]]
    forget_records: Callable[[], Awaitable[None]]


async def measure(
    generator: Movable, trainer: Movable, work: Workload, cpus: list[int]
) -> PhaseCosts:
    """Measures the phase costs with the run's generator and trainer, which must both hold
    `cpus`; leaves them both on all of `cpus`."""
    counts = core_counts(len(cpus))
    generate: dict[int, float] = {}
    await work.rollouts(1, SEED_BASE)  # untimed: an engine's first requests run slowly
    episodes: list = []
    for c in reversed(counts):  # all cores first: its episodes are the ones the trainer times
        await generator.use_cores(cpus[:c])
        start = time.perf_counter()
        batch = await work.rollouts(None, SEED_BASE)
        generate[c] = time.perf_counter() - start
        episodes = episodes or batch
    await generator.use_cores(cpus)
    train, stale = {}, {}
    for c in reversed(counts):
        await trainer.use_cores(cpus[:c])
        costs = await work.train_costs(episodes)
        train[c], stale[c] = costs["train_s"], costs["stale_s"]
    await trainer.use_cores(cpus)
    return PhaseCosts(generate, train, stale, await _sync_s(work))


async def _sync_s(work: Workload) -> float:
    """The fastest of four real syncs: to a scratch version of the same weights and back to the
    run's own (which deletes the scratch one), twice. A run's first syncs also fill its buffers:
    the second was already as fast as the steady state in float32, the third in bfloat16."""
    times = []
    for _ in range(2):
        for sync in (work.sync_away, work.sync_back):
            start = time.perf_counter()
            await sync()
            times.append(time.perf_counter() - start)
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
