"""Replay buffer: holds scored episodes between the rollout loop and the trainer, in groups.

    buffer = await ReplayBuffer.as_actor(ReplayBufferConfig(batch_size=16, dp_size=2))
    await buffer.add.call_one(episodes)  # whole groups: episodes sharing a group_id
    sampled = await buffer.sample.call_one(curr_policy_version=v, wait_s=60)
    sampled.batch  # 2 lists of 8 (None: not ready in time)

The unit of sampling, reuse, retirement and eviction is the group (`Episode.group_id`): GRPO
normalises rewards within a group, so a group split across batches, or partly evicted, trains
on advantages that no longer add up. A batch is whole groups, so `batch_size` must be a
multiple of the group size; the ranks' lists may cut a group, but its episodes stay contiguous.

The logic lives in `EpisodeBuffer`, a plain class tested without processes; `ReplayBuffer` is
the actor around it. A group's age is `curr_policy_version` minus the oldest policy version that
sampled any of its tokens; groups older than `max_policy_age` are dropped before every sample,
so the trainer never sees them (docs/architecture.md, staleness). So are groups with a token
from a policy newer than the trainer's (a trainer restarted from an older checkpoint): the
weights that made them are gone. `max_policy_age: 0` is sync mode: only groups of the current
version are trainable.
"""

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from monarch.actor import endpoint
from monarch.actor.concurrent import concurrent_endpoint

from forge.config import positive
from forge.controller import ForgeActor, retry_safe
from forge.data.completion import Completion
from forge.data.episode import Episode


class Sampler(Protocol):
    """Chooses which buffered groups (by index, oldest first) go into the next batch."""

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
    """Oldest first. With `max_reuse > 1` the oldest groups are reused before newer ones,
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


# How the buffer chooses a batch's groups (ReplayBufferConfig.sampling).
Sampling = Literal["fifo", "random"]
# The sampler of each Sampling, by name; each factory takes the config's seed. Its keys are
# get_args(Sampling) (tests/unit/test_replay_buffer.py checks it).
SAMPLERS: dict[Sampling, Callable[[int], Sampler]] = {
    "fifo": lambda seed: FifoSampler(),
    "random": RandomSampler,
}


@dataclass
class ReplayBufferConfig:
    """How many episodes the buffer holds and how it hands them to the trainer.

    Args:
        capacity: most episodes held; adding to a full buffer evicts the oldest groups.
        batch_size: episodes per training step, over all data-parallel ranks: a multiple of
            the group size (every group added must have the same size).
        dp_size: the trainer's data-parallel ranks; a batch is `dp_size` lists of
            `batch_size // dp_size` episodes. A run's config derives it from
            trainer_resources (RLConfig), so no yaml sets it.
        max_policy_age: oldest trainable group, in policy versions behind the trainer's.
            0 is sync mode.
        sampling: "fifo" (oldest groups first) or "random" (uniform over groups, seeded).
        max_reuse: how many batches one group may be in; 1 trains on each group once.
        seed: seeds "random" sampling.
        sample_timeout_s: how long the trainer waits for a batch before the run fails, naming
            what the buffer holds (rollouts that stall, or never fill a batch).
    """

    capacity: int = 4096
    batch_size: int = 8
    dp_size: int = 1
    max_policy_age: int = 1
    sampling: Sampling = "fifo"
    max_reuse: int = 1
    seed: int = 0
    sample_timeout_s: float = 3600.0

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "dp_size": "derived from trainer_resources (procs x hosts: one list per trainer rank): "
        "remove it",
    }

    def __post_init__(self) -> None:
        for name in ("capacity", "batch_size", "dp_size", "max_reuse"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_policy_age < 0:
            raise ValueError(f"max_policy_age must be >= 0, got {self.max_policy_age}")
        if self.sampling not in SAMPLERS:
            raise ValueError(f"sampling must be one of {tuple(SAMPLERS)}, got {self.sampling!r}")
        _check_batch_size(self.batch_size, self.dp_size, self.capacity)
        positive(self, "sample_timeout_s")


def _check_batch_size(batch_size: int, dp_size: int, capacity: int) -> None:
    if batch_size < 1 or batch_size % dp_size:
        raise ValueError(
            f"batch_size must be a positive multiple of dp_size {dp_size}, got {batch_size}"
        )
    if batch_size > capacity:
        # Such a batch could never be filled: the trainer would wait forever.
        raise ValueError(f"batch_size {batch_size} exceeds the buffer's capacity {capacity}")


def _check_whole_groups(batch_size: int, group_size: int) -> None:
    # With batch_size <= capacity (checked first), that many whole groups always fit.
    if batch_size % group_size:
        raise ValueError(
            f"batch_size {batch_size} is not a multiple of the group size {group_size}: "
            "a batch holds whole groups"
        )


@dataclass
class _Group:
    """One group's episodes, which are sampled, reused, retired and evicted together."""

    episodes: list[Episode]
    uses: int = 0  # batches it has been in

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version behind any of its tokens: the group's age counts from it."""
        return min(e.policy_version for e in self.episodes)

    @property
    def newest_version(self) -> int:
        """The newest policy version behind any of its tokens."""
        return max(max(e.completion.token_versions) for e in self.episodes)


@dataclass
class _Counters:
    """Running totals in episodes, except `groups_dropped`;
    `added == size + retired + evicted_stale + evicted_capacity`."""

    added: int = 0
    sampled: int = 0  # episodes handed out, reuses included
    reused: int = 0  # of those, ones handed out before
    retired: int = 0  # removed after their group's `max_reuse`-th batch
    evicted_stale: int = 0  # too old, or newer than the trainer's policy (next line)
    evicted_newer: int = 0  # of evicted_stale: sampled by a policy newer than the trainer's
    evicted_capacity: int = 0
    groups_dropped: int = 0  # groups evicted (stale, newer or capacity), always whole


class EpisodeBuffer:
    """The replay buffer's logic: bounded, version-aware, group-whole, resumable. No processes."""

    def __init__(self, cfg: ReplayBufferConfig) -> None:
        self.cfg = cfg
        self.clear()

    def clear(self) -> None:
        """Empties the buffer and resets counters, sampler and group size, as if newly made."""
        self._groups: list[_Group] = []
        self._group_size: int | None = None  # set by the first group added
        self._counters = _Counters()
        self._last_ages: list[int] = []
        self._sampler = SAMPLERS[self.cfg.sampling](self.cfg.seed)

    def add(self, episodes: list[Episode]) -> None:
        """Appends whole groups; when over capacity, evicts the oldest groups (counted in stats).

        Episodes sharing a `group_id` form a group and must all come in this one call. Every
        group has the size of the first group ever added, which must divide `batch_size`.

        Raises:
            ValueError: an empty completion, a group of another size, a group already buffered
                (added in two calls), or a group size that does not divide `batch_size`.
                Nothing is added then.
        """
        groups = self._make_groups(episodes)
        if groups:
            self._group_size = len(groups[0])
        self._groups.extend(groups)
        self._counters.added += len(episodes)
        self._evict_over_capacity()

    def sample(
        self, curr_policy_version: int, batch_size: int | None = None
    ) -> list[list[Episode]] | None:
        """Drops stale groups, then takes whole groups for a batch shaped for the trainer's ranks.

        Args:
            curr_policy_version: the trainer's version; groups more than `max_policy_age`
                versions behind it, or with a token from a newer policy, are evicted first.
            batch_size: episodes in the batch; defaults to the config's. Must be a multiple
                of `dp_size` and of the group size.

        Returns:
            `dp_size` lists of `batch_size // dp_size` episodes (each group's episodes
            contiguous), or None if fewer than `batch_size` trainable episodes are buffered
            (nothing is taken then).
        """
        n = self.cfg.batch_size if batch_size is None else batch_size
        _check_batch_size(n, self.cfg.dp_size, self.cfg.capacity)
        if self._group_size is not None:
            _check_whole_groups(n, self._group_size)
        self._evict_stale(curr_policy_version)
        if self._size() < n:
            return None
        # Every group has the group size, so n // group size groups make the batch.
        picks = self._sampler.select(len(self._groups), n // len(self._groups[0]))
        chosen = [self._groups[i] for i in picks]
        self._count_uses(chosen)
        episodes = [e for group in chosen for e in group.episodes]
        self._last_ages = [curr_policy_version - e.policy_version for e in episodes]
        per_rank = n // self.cfg.dp_size
        return [episodes[r * per_rank : (r + 1) * per_rank] for r in range(self.cfg.dp_size)]

    def stats(self) -> dict[str, int | float | None]:
        """Size, running totals, and the policy age of the last batch.

        Keys: size, groups (buffered), added, sampled, reused, retired, evicted_stale
        (evicted_newer included), evicted_newer, evicted_capacity: running totals in episodes
        since the buffer was made or cleared; episodes that left the buffer are
        retired + evicted_stale + evicted_capacity. groups_dropped: groups evicted, always
        whole. policy_age_min, policy_age_mean, policy_age_max: of the last batch's episodes
        (None before the first batch).
        """
        ages = self._last_ages
        return {
            "size": self._size(),
            "groups": len(self._groups),
            **dataclasses.asdict(self._counters),
            "policy_age_min": min(ages) if ages else None,
            "policy_age_mean": sum(ages) / len(ages) if ages else None,
            "policy_age_max": max(ages) if ages else None,
        }

    def versions(self) -> dict[int, int]:
        """How many buffered episodes each policy version made (a group counts at its oldest
        token's version, as its age does)."""
        counts: dict[int, int] = {}
        for group in self._groups:
            v = group.oldest_version
            counts[v] = counts.get(v, 0) + len(group)
        return dict(sorted(counts.items()))

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: groups, reuse counts, group size, totals, sampler state.

        Made of dicts, lists, strings and numbers, so it pickles, and it survives JSON too as
        long as the episodes' `metadata` does.
        """
        return {
            "groups": [
                {"episodes": [dataclasses.asdict(e) for e in g.episodes], "uses": g.uses}
                for g in self._groups
            ],
            "group_size": self._group_size,
            "counters": dataclasses.asdict(self._counters),
            "last_ages": list(self._last_ages),
            "sampler": self._sampler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replaces the contents with a `state_dict()`; over capacity, the oldest groups are
        evicted.

        Raises:
            ValueError: the saved group size does not divide this buffer's `batch_size`.
        """
        group_size = state["group_size"]
        if group_size is not None:
            _check_whole_groups(self.cfg.batch_size, group_size)
        self._groups = [
            _Group([_episode_from_dict(e) for e in g["episodes"]], g["uses"])
            for g in state["groups"]
        ]
        self._group_size = group_size
        self._counters = _Counters(**state["counters"])
        self._last_ages = list(state["last_ages"])
        self._sampler.load_state_dict(state["sampler"])
        self._evict_over_capacity()

    def _make_groups(self, episodes: list[Episode]) -> list[_Group]:
        """Groups `episodes` by `group_id` (in order of first appearance) and checks them."""
        by_id: dict[str, list[Episode]] = {}
        for episode in episodes:
            if episode.policy_version is None:
                raise ValueError(
                    f"episode {episode.episode_id} has no policy version (empty completion): "
                    "there is nothing to train on"
                )
            by_id.setdefault(episode.group_id, []).append(episode)
        if not by_id:
            return []
        buffered = {g.episodes[0].group_id for g in self._groups}
        size = self._group_size or len(next(iter(by_id.values())))  # the first group's
        for group_id, members in by_id.items():
            if group_id in buffered:
                raise ValueError(
                    f"group {group_id!r} is already in the buffer: add each group whole, in one "
                    "call"
                )
            if len(members) != size:
                raise ValueError(
                    f"group {group_id!r} has {len(members)} episodes, the buffer's groups have "
                    f"{size}: add each group whole, in one call"
                )
        _check_whole_groups(self.cfg.batch_size, size)
        return [_Group(members) for members in by_id.values()]

    def _size(self) -> int:
        return sum(len(g) for g in self._groups)

    def _drop(self, group: _Group) -> int:
        """Counts `group` as dropped whole; returns its episodes, for the reason's counter."""
        self._counters.groups_dropped += 1
        return len(group)

    def _evict_stale(self, curr_policy_version: int) -> None:
        limit = self.cfg.max_policy_age
        kept = []
        for group in self._groups:
            newer = group.newest_version > curr_policy_version
            if not newer and curr_policy_version - group.oldest_version <= limit:
                kept.append(group)
                continue
            self._counters.evicted_stale += self._drop(group)
            if newer:
                self._counters.evicted_newer += len(group)
        self._groups = kept

    def _evict_over_capacity(self) -> None:
        while self._size() > self.cfg.capacity:
            self._counters.evicted_capacity += self._drop(self._groups.pop(0))

    def _count_uses(self, chosen: list[_Group]) -> None:
        """Counts one more use of each chosen group; retires those at `max_reuse`."""
        for group in chosen:
            self._counters.reused += len(group) if group.uses else 0
            self._counters.sampled += len(group)
            group.uses += 1
        kept = [g for g in self._groups if g.uses < self.cfg.max_reuse]
        self._counters.retired += self._size() - sum(len(g) for g in kept)
        self._groups = kept


def _episode_from_dict(fields: dict[str, Any]) -> Episode:
    return Episode(**{**fields, "completion": Completion(**fields["completion"])})


class ReplayBuffer(ForgeActor):
    """The replay buffer as an actor: `EpisodeBuffer`'s methods as endpoints."""

    def __init__(self, cfg: ReplayBufferConfig | None = None) -> None:
        super().__init__()
        self.buffer = EpisodeBuffer(cfg or ReplayBufferConfig())
        self._changed = asyncio.Condition()  # notified when groups come, go, or are replaced

    @endpoint
    async def add(self, episodes: list[Episode]) -> None:
        """See `EpisodeBuffer.add`."""
        self.buffer.add(episodes)
        await self._changed_now()

    # Concurrent: while it waits for a batch, `add` is served.
    @concurrent_endpoint
    async def sample(
        self,
        curr_policy_version: int,
        batch_size: int | None = None,
        wait_s: float = 0.0,
        known_left: int | None = None,
    ) -> "Sampled":
        """Takes a batch (`EpisodeBuffer.sample`), waiting up to `wait_s` seconds for one.

        Returns early without a batch when more episodes left the buffer (evicted stale or over
        capacity) than `known_left` (default: as many as when called) and no batch is ready:
        whoever counts what is buffered (the admission gate) must learn it, or nothing would
        refill the buffer.
        """
        left = left_buffer(self.buffer.stats()) if known_left is None else known_left
        batch = None

        def ready() -> bool:
            nonlocal batch
            batch = self.buffer.sample(curr_policy_version, batch_size)
            return batch is not None or left_buffer(self.buffer.stats()) > left

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s), self._changed:
                await self._changed.wait_for(ready)
        return Sampled(batch, self.buffer.stats())

    @endpoint
    @retry_safe
    async def stats(self) -> dict[str, int | float | None]:
        """See `EpisodeBuffer.stats`."""
        return self.buffer.stats()

    @endpoint
    @retry_safe
    async def versions(self) -> dict[int, int]:
        """See `EpisodeBuffer.versions`."""
        return self.buffer.versions()

    @endpoint
    @retry_safe
    async def state_dict(self) -> dict[str, Any]:
        """See `EpisodeBuffer.state_dict`."""
        return self.buffer.state_dict()

    @endpoint
    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """See `EpisodeBuffer.load_state_dict`."""
        self.buffer.load_state_dict(state)
        await self._changed_now()

    @endpoint
    async def set_max_policy_age(self, max_policy_age: int) -> None:
        """Groups more than `max_policy_age` versions behind are dropped from the next sample
        on (a live run's change: forge.loop.live_control)."""
        self.buffer.cfg.max_policy_age = max_policy_age
        await self._changed_now()

    @endpoint
    async def clear(self) -> None:
        """See `EpisodeBuffer.clear`."""
        self.buffer.clear()
        await self._changed_now()

    async def _changed_now(self) -> None:
        """Wakes a `sample` waiting for a batch, to look again."""
        async with self._changed:
            self._changed.notify_all()


@dataclass
class Sampled:
    """What `ReplayBuffer.sample` returns.

    Args:
        batch: the batch, or None where none was ready.
        stats: the buffer's `stats()` once the batch was taken.
    """

    batch: list[list[Episode]] | None
    stats: dict[str, int | float | None]

    @property
    def left(self) -> int:
        """Episodes that left the buffer so far (`left_buffer` of `stats`)."""
        return left_buffer(self.stats)


def left_buffer(stats: dict[str, Any]) -> int:
    """Episodes that ever left the buffer: retired after their last use, or evicted."""
    return stats["retired"] + stats["evicted_stale"] + stats["evicted_capacity"]
