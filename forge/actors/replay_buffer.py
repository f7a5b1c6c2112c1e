"""Replay buffer: holds scored episodes between the rollout loop and the trainer.

    buffer = await ReplayBuffer.as_actor(ReplayBufferConfig(batch_size=16, dp_size=2))
    await buffer.add.call_one(episodes)
    batch = await buffer.sample.call_one(curr_policy_version=v)  # 2 lists of 8, or None

The logic lives in `EpisodeBuffer`, a plain class tested without processes; `ReplayBuffer` is
the actor around it. An episode's age is `curr_policy_version - episode.policy_version` (the
oldest policy that sampled any of its tokens); episodes older than `max_policy_age` are dropped
before every sample, so the trainer never sees them (docs/architecture.md, staleness).
`max_policy_age: 0` is sync mode: only episodes of the current version are trainable.
"""

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from monarch.actor import endpoint

from forge.controller import ForgeActor, retry_safe
from forge.data.completion import Completion
from forge.data.episode import Episode


class Sampler(Protocol):
    """Chooses which buffered episodes (by index, oldest first) go into the next batch."""

    def select(self, size: int, n: int) -> list[int]:
        """`n` distinct indices in `range(size)`, in batch order; `n <= size`."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What the sampler needs to make the same choices after a resume."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""
        ...


class FifoSampler:
    """Oldest first. With `max_reuse > 1` the oldest episodes are reused before newer ones,
    so they are trained on before they grow stale."""

    def select(self, size: int, n: int) -> list[int]:
        return list(range(n))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class RandomSampler:
    """Uniformly at random without replacement, from a seeded generator."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def select(self, size: int, n: int) -> list[int]:
        return self._rng.sample(range(size), n)

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = self._rng.getstate()
        # Lists, not tuples: the state must survive a JSON round trip.
        return {"rng": [version, list(internal), gauss_next]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss_next = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss_next))


# Sampling strategies by config name; each factory takes the config's seed.
SAMPLERS: dict[str, Callable[[int], Sampler]] = {
    "fifo": lambda seed: FifoSampler(),
    "random": RandomSampler,
}


@dataclass
class ReplayBufferConfig:
    """How many episodes the buffer holds and how it hands them to the trainer.

    Args:
        capacity: most episodes held; adding to a full buffer evicts the oldest.
        batch_size: episodes per training step, over all data-parallel ranks.
        dp_size: the trainer's data-parallel ranks; a batch is `dp_size` lists of
            `batch_size // dp_size` episodes.
        max_policy_age: oldest trainable episode, in policy versions behind the trainer's.
            0 is sync mode.
        sampling: "fifo" (oldest first) or "random" (uniform, seeded).
        max_reuse: how many batches one episode may be in; 1 trains on each episode once.
        seed: seeds "random" sampling.
    """

    capacity: int = 4096
    batch_size: int = 8
    dp_size: int = 1
    max_policy_age: int = 1
    sampling: Literal["fifo", "random"] = "fifo"
    max_reuse: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("capacity", "batch_size", "dp_size", "max_reuse"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_policy_age < 0:
            raise ValueError(f"max_policy_age must be >= 0, got {self.max_policy_age}")
        if self.sampling not in SAMPLERS:
            raise ValueError(f"sampling must be one of {tuple(SAMPLERS)}, got {self.sampling!r}")
        _check_batch_size(self.batch_size, self.dp_size, self.capacity)


def _check_batch_size(batch_size: int, dp_size: int, capacity: int) -> None:
    if batch_size < 1 or batch_size % dp_size:
        raise ValueError(
            f"batch_size must be a positive multiple of dp_size {dp_size}, got {batch_size}"
        )
    if batch_size > capacity:
        # Such a batch could never be filled: the trainer would wait forever.
        raise ValueError(f"batch_size {batch_size} exceeds the buffer's capacity {capacity}")


@dataclass
class _Entry:
    episode: Episode
    uses: int = 0  # batches it has been in


@dataclass
class _Counters:
    """Running totals; `added == size + retired + evicted_stale + evicted_capacity`."""

    added: int = 0
    sampled: int = 0  # episodes handed out, reuses included
    reused: int = 0  # of those, ones handed out before
    retired: int = 0  # removed after their `max_reuse`-th batch
    evicted_stale: int = 0
    evicted_capacity: int = 0


class EpisodeBuffer:
    """The replay buffer's logic: bounded, version-aware, resumable. No processes involved."""

    def __init__(self, cfg: ReplayBufferConfig) -> None:
        self.cfg = cfg
        self.clear()

    def clear(self) -> None:
        """Empties the buffer and resets counters and sampler, as if newly made."""
        self._entries: list[_Entry] = []
        self._counters = _Counters()
        self._last_ages: list[int] = []
        self._sampler = SAMPLERS[self.cfg.sampling](self.cfg.seed)

    def add(self, episodes: list[Episode]) -> None:
        """Appends episodes; when over capacity, evicts the oldest (counted in stats)."""
        for episode in episodes:
            if episode.policy_version is None:
                raise ValueError(
                    f"episode {episode.episode_id} has no policy version (empty completion): "
                    "there is nothing to train on"
                )
        self._entries.extend(_Entry(episode) for episode in episodes)
        self._counters.added += len(episodes)
        self._evict_over_capacity()

    def sample(
        self, curr_policy_version: int, batch_size: int | None = None
    ) -> list[list[Episode]] | None:
        """Drops stale episodes, then takes a batch shaped for the trainer's ranks.

        Args:
            curr_policy_version: the trainer's version; episodes more than `max_policy_age`
                versions behind it are evicted first.
            batch_size: episodes in the batch; defaults to the config's. Must be a multiple
                of `dp_size`.

        Returns:
            `dp_size` lists of `batch_size // dp_size` episodes, or None if fewer than
            `batch_size` trainable episodes are buffered (nothing is taken then).
        """
        n = self.cfg.batch_size if batch_size is None else batch_size
        _check_batch_size(n, self.cfg.dp_size, self.cfg.capacity)
        self._evict_stale(curr_policy_version)
        if len(self._entries) < n:
            return None
        chosen = [self._entries[i] for i in self._sampler.select(len(self._entries), n)]
        self._count_uses(chosen)
        self._last_ages = [curr_policy_version - e.episode.policy_version for e in chosen]
        per_rank = n // self.cfg.dp_size
        episodes = [e.episode for e in chosen]
        return [episodes[r * per_rank : (r + 1) * per_rank] for r in range(self.cfg.dp_size)]

    def stats(self) -> dict[str, int | float | None]:
        """Size, running totals, and the policy age of the last batch.

        Keys: size, added, sampled, reused, retired, evicted_stale, evicted_capacity (running
        totals since the buffer was made or cleared; episodes that left the buffer are
        retired + evicted_stale + evicted_capacity), and policy_age_min, policy_age_mean,
        policy_age_max (None before the first batch).
        """
        ages = self._last_ages
        return {
            "size": len(self._entries),
            **dataclasses.asdict(self._counters),
            "policy_age_min": min(ages) if ages else None,
            "policy_age_mean": sum(ages) / len(ages) if ages else None,
            "policy_age_max": max(ages) if ages else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: episodes, reuse counts, totals, sampler state.

        Made of dicts, lists, strings and numbers, so it pickles, and it survives JSON too as
        long as the episodes' `metadata` does.
        """
        return {
            "entries": [
                {"episode": dataclasses.asdict(e.episode), "uses": e.uses} for e in self._entries
            ],
            "counters": dataclasses.asdict(self._counters),
            "last_ages": list(self._last_ages),
            "sampler": self._sampler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replaces the contents with a `state_dict()`; over capacity, the oldest are evicted."""
        self._entries = [
            _Entry(_episode_from_dict(e["episode"]), e["uses"]) for e in state["entries"]
        ]
        self._counters = _Counters(**state["counters"])
        self._last_ages = list(state["last_ages"])
        self._sampler.load_state_dict(state["sampler"])
        self._evict_over_capacity()

    def _evict_stale(self, curr_policy_version: int) -> None:
        limit = self.cfg.max_policy_age
        fresh = [
            e for e in self._entries if curr_policy_version - e.episode.policy_version <= limit
        ]
        self._counters.evicted_stale += len(self._entries) - len(fresh)
        self._entries = fresh

    def _evict_over_capacity(self) -> None:
        excess = len(self._entries) - self.cfg.capacity
        if excess > 0:
            del self._entries[:excess]
            self._counters.evicted_capacity += excess

    def _count_uses(self, chosen: list[_Entry]) -> None:
        """Counts one more use of each chosen entry; retires those at `max_reuse`."""
        for entry in chosen:
            self._counters.reused += entry.uses > 0
            entry.uses += 1
        self._counters.sampled += len(chosen)
        kept = [e for e in self._entries if e.uses < self.cfg.max_reuse]
        self._counters.retired += len(self._entries) - len(kept)
        self._entries = kept


def _episode_from_dict(fields: dict[str, Any]) -> Episode:
    return Episode(**{**fields, "completion": Completion(**fields["completion"])})


class ReplayBuffer(ForgeActor):
    """The replay buffer as an actor: `EpisodeBuffer`'s methods as endpoints."""

    def __init__(self, cfg: ReplayBufferConfig | None = None) -> None:
        super().__init__()
        self.buffer = EpisodeBuffer(cfg or ReplayBufferConfig())

    @endpoint
    async def add(self, episodes: list[Episode]) -> None:
        """See `EpisodeBuffer.add`."""
        self.buffer.add(episodes)

    @endpoint
    async def sample(
        self, curr_policy_version: int, batch_size: int | None = None
    ) -> list[list[Episode]] | None:
        """See `EpisodeBuffer.sample`."""
        return self.buffer.sample(curr_policy_version, batch_size)

    @endpoint
    @retry_safe
    async def stats(self) -> dict[str, int | float | None]:
        """See `EpisodeBuffer.stats`."""
        return self.buffer.stats()

    @endpoint
    @retry_safe
    async def state_dict(self) -> dict[str, Any]:
        """See `EpisodeBuffer.state_dict`."""
        return self.buffer.state_dict()

    @endpoint
    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """See `EpisodeBuffer.load_state_dict`."""
        self.buffer.load_state_dict(state)

    @endpoint
    async def clear(self) -> None:
        """See `EpisodeBuffer.clear`."""
        self.buffer.clear()
