"""EpisodeBuffer: whole groups in ordering, shaping, staleness, capacity, reuse, resume, stats."""

import itertools
import json
import pickle
import random
from typing import get_args

import pytest

from forge.actors.buffer import SAMPLERS, EpisodeBuffer, ReplayBufferConfig, Sampling
from forge.config import ConfigError, load_config
from forge.data import Completion, Episode
from forge.loop import RLConfig

G = 2  # episodes per group, unless a test says otherwise


def episode(i: int, version: int = 0, newest: int | None = None, size: int = G) -> Episode:
    """Episode `e{i}` of group `g{i // size}`: its first token is from `version`, its last from
    `newest` (default the same; a newer one, as after an in-flight update)."""
    newest = version if newest is None else newest
    completion = Completion([1, 2], [3, 4], "ab", [-0.5, -0.25], [version, newest], "stop")
    return Episode(f"e{i}", f"g{i // size}", completion, reward=float(i), rewards={"math": 1.0})


def ids(batch: list[list[Episode]]) -> list[list[str]]:
    return [[e.episode_id for e in rank] for rank in batch]


def group_ids(batch: list[list[Episode]]) -> list[str]:
    """The batch's groups in order; fails unless each is whole and contiguous over the ranks."""
    runs = [
        (group, len(list(members)))
        for group, members in itertools.groupby(e.group_id for rank in batch for e in rank)
    ]
    groups = [group for group, _ in runs]
    assert len(set(groups)) == len(groups), f"a group is split within the batch: {runs}"
    return groups


def make(**overrides) -> EpisodeBuffer:
    return EpisodeBuffer(ReplayBufferConfig(**{"capacity": 64, "batch_size": 4, **overrides}))


def left(stats: dict) -> int:
    """Episodes that left the buffer, as the admission gate counts consumption."""
    return stats["retired"] + stats["evicted_stale"] + stats["evicted_capacity"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batch_size": 6, "dp_size": 4}, "batch_size must be a positive multiple of dp_size 4"),
        ({"batch_size": 8, "capacity": 4}, "batch_size 8 exceeds the buffer's capacity 4"),
        ({"max_policy_age": -1}, "max_policy_age must be >= 0"),
        ({"max_reuse": 0}, "max_reuse must be >= 1"),
        ({"sampling": "lifo"}, "sampling must be one of"),
    ],
)
def test_config_refuses_impossible_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        ReplayBufferConfig(**overrides)


def test_config_errors_name_the_key_when_loaded():
    # dp_size is the trainer's ranks, which a run's config fills in: no input sets it.
    with pytest.raises(ConfigError, match="dp_size: derived from trainer_resources"):
        load_config(ReplayBufferConfig, None, ["batch_size=6", "dp_size=4"])
    with pytest.raises(ConfigError, match="buffer.batch_size 6 must be a multiple of .* = 4"):
        load_config(
            RLConfig, None, ["buffer.batch_size=6", "group_size=2", "trainer_resources.procs=4"]
        )
    with pytest.raises(ConfigError, match="sampling"):
        load_config(ReplayBufferConfig, None, ["sampling=lifo"])


def test_every_sampling_name_has_a_sampler():
    assert set(SAMPLERS) == set(get_args(Sampling))


def test_fifo_hands_out_oldest_groups_first_and_each_once():
    buffer = make()
    buffer.add([episode(i) for i in range(10)])
    assert ids(buffer.sample(0)) == [["e0", "e1", "e2", "e3"]]
    assert ids(buffer.sample(0)) == [["e4", "e5", "e6", "e7"]]
    assert buffer.sample(0) is None  # one group left


def test_a_group_may_straddle_ranks_but_stays_contiguous():
    buffer = make(batch_size=6, dp_size=3)
    buffer.add([episode(i, size=3) for i in range(15)])
    batch = buffer.sample(0)
    assert ids(batch) == [["e0", "e1"], ["e2", "e3"], ["e4", "e5"]]
    assert group_ids(batch) == ["g0", "g1"]
    assert ids(buffer.sample(0, batch_size=9)) == [
        ["e6", "e7", "e8"],
        ["e9", "e10", "e11"],
        ["e12", "e13", "e14"],
    ]
    with pytest.raises(ValueError, match="multiple of dp_size 3, got 4"):
        buffer.sample(0, batch_size=4)


def test_episodes_of_one_group_stay_together_whatever_order_they_come_in():
    buffer = make()
    arrivals = [episode(i) for i in (2, 0, 3, 1)]  # g1, g0, g1, g0 interleaved
    buffer.add(arrivals)
    assert ids(buffer.sample(0)) == [["e2", "e3", "e0", "e1"]]


def test_random_sampling_takes_whole_groups_determined_by_the_seed():
    def draws(seed: int) -> list[list[list[str]]]:
        buffer = make(sampling="random", seed=seed, max_reuse=3, dp_size=2)
        buffer.add([episode(i) for i in range(12)])
        batches = [buffer.sample(0) for _ in range(5)]
        for batch in batches:
            assert len(group_ids(batch)) == 2  # two whole groups, each contiguous
        return [ids(batch) for batch in batches]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    fifo = [["e0", "e1"], ["e2", "e3"]]
    assert any(batch != fifo for batch in draws(7))


def test_not_enough_fresh_episodes_gives_none_and_takes_nothing():
    buffer = make()
    buffer.add([episode(i) for i in range(2)])
    assert buffer.sample(0) is None
    assert buffer.stats()["size"] == 2 and buffer.stats()["sampled"] == 0
    buffer.add([episode(i) for i in range(2, 4)])
    assert ids(buffer.sample(0)) == [["e0", "e1", "e2", "e3"]]


def test_a_group_is_as_old_as_its_oldest_episode():
    # Mixed versions inside a group, as `abort`/`inflight` updates make: g0 holds a version-2
    # sample beside a version-3 one, so at version 4 with max age 1 it goes, whole.
    buffer = make(batch_size=2, max_policy_age=1)
    buffer.add([episode(0, version=3), episode(1, version=2)])
    buffer.add([episode(2, version=3), episode(3, version=3)])
    assert ids(buffer.sample(curr_policy_version=4)) == [["e2", "e3"]]
    stats = buffer.stats()
    assert (stats["evicted_stale"], stats["groups_dropped"], stats["size"]) == (2, 1, 0)


def test_stale_boundary_keeps_age_equal_to_max_and_evicts_one_older():
    buffer = make(batch_size=2, max_policy_age=2)
    buffer.add([episode(i, version=v) for i, v in enumerate([2, 2, 3, 3])])
    assert ids(buffer.sample(curr_policy_version=5)) == [["e2", "e3"]]  # ages 3, then 2
    assert buffer.stats()["evicted_stale"] == 2


def test_sync_mode_trains_only_on_the_current_version():
    buffer = make(batch_size=2, max_policy_age=0)
    buffer.add([episode(i, version=v) for i, v in enumerate([4, 4, 5, 5])])
    assert ids(buffer.sample(5)) == [["e2", "e3"]]
    assert buffer.stats()["evicted_stale"] == 2
    buffer.add([episode(i, version=5) for i in (4, 5)])
    assert buffer.sample(6) is None  # both one version old now
    assert (buffer.stats()["evicted_stale"], buffer.stats()["groups_dropped"]) == (4, 2)


def test_groups_from_a_policy_newer_than_the_trainer_are_evicted_and_counted():
    # A trainer restarted from the version-3 checkpoint: whatever versions 4+ sampled is gone,
    # a group with a single such token included.
    buffer = make(batch_size=2, max_policy_age=2)
    buffer.add([episode(0, version=3, newest=3), episode(1, version=2, newest=4)])  # g0
    buffer.add([episode(i, version=4) for i in (2, 3)])  # g1
    buffer.add([episode(i, version=2, newest=3) for i in (4, 5)])  # g2
    assert ids(buffer.sample(curr_policy_version=3)) == [["e4", "e5"]]
    stats = buffer.stats()
    assert (stats["evicted_newer"], stats["evicted_stale"], stats["groups_dropped"]) == (4, 4, 2)
    assert stats["added"] == stats["size"] + left(stats)


def test_full_buffer_evicts_the_oldest_groups_whole_and_counts_them():
    buffer = make(capacity=5, batch_size=4)
    buffer.add([episode(i) for i in range(4)])
    buffer.add([episode(i) for i in range(4, 6)])  # 6 > 5: g0 goes, not just e0
    stats = buffer.stats()
    assert (stats["size"], stats["evicted_capacity"], stats["groups_dropped"]) == (4, 2, 1)
    assert ids(buffer.sample(0)) == [["e2", "e3", "e4", "e5"]]


def test_reuse_cap_retires_a_group_after_its_last_batch():
    buffer = make(batch_size=2, max_reuse=2)
    buffer.add([episode(i) for i in range(4)])
    assert ids(buffer.sample(0)) == ids(buffer.sample(0)) == [["e0", "e1"]]
    assert ids(buffer.sample(0)) == [["e2", "e3"]]
    stats = buffer.stats()
    assert (stats["size"], stats["sampled"], stats["reused"], stats["retired"]) == (2, 6, 2, 2)


def test_groups_that_would_be_split_are_refused_and_nothing_is_added():
    buffer = make(batch_size=4)
    buffer.add([episode(i) for i in range(2)])  # the group size is 2 from now on
    with pytest.raises(ValueError, match="group 'g1' has 3 episodes, the buffer's groups have 2"):
        buffer.add([episode(2), episode(3), episode(4, size=3)])  # g1 holds e2, e3, e4 here
    with pytest.raises(ValueError, match="group 'g0' is already in the buffer"):
        buffer.add([episode(0)])
    assert buffer.stats()["added"] == 2
    with pytest.raises(ValueError, match="batch_size 5 is not a multiple of the group size 2"):
        buffer.sample(0, batch_size=5)
    with pytest.raises(ValueError, match="batch_size 4 is not a multiple of the group size 3"):
        make(batch_size=4).add([episode(i, size=3) for i in range(3)])


def test_empty_completion_is_refused():
    empty = Episode("e9", "g9", Completion([1], [], "", [], [], "abort"))
    with pytest.raises(ValueError, match="episode e9 has no policy version"):
        make().add([empty])


def test_stats_report_totals_and_ages_of_the_last_batch():
    buffer = make(capacity=6, batch_size=4, max_policy_age=3)
    assert buffer.stats()["policy_age_mean"] is None
    buffer.add([episode(i, version=v) for i, v in enumerate([0, 0, 4, 5, 6, 6, 6, 6])])
    buffer.sample(curr_policy_version=6)  # g0 evicted for capacity; ages of e2..e5: 2, 1, 0, 0
    stats = buffer.stats()
    assert stats == {
        "size": 2,
        "groups": 1,
        "added": 8,
        "sampled": 4,
        "reused": 0,
        "retired": 4,
        "evicted_stale": 0,
        "evicted_newer": 0,
        "evicted_capacity": 2,
        "groups_dropped": 1,
        "policy_age_min": 0,
        "policy_age_mean": 0.75,
        "policy_age_max": 2,
    }
    assert stats["added"] == stats["size"] + left(stats)


@pytest.mark.parametrize("sampling", ["fifo", "random"])
def test_every_batch_is_whole_groups_and_the_counts_add_up(sampling):
    """Random adds (mixed versions), samples and version moves, backwards ones included."""
    rng = random.Random(0)
    buffer = make(capacity=24, batch_size=6, dp_size=2, sampling=sampling, max_reuse=2)
    buffer.add([])  # nothing: the group size stays unknown
    version, count, trained = 0, 0, 0
    for _ in range(300):
        if rng.random() < 0.5:
            groups = rng.randrange(1, 4)
            episodes = []
            for i in range(count, count + groups * 3):
                oldest = version - rng.randrange(3)
                newest = min(oldest + rng.randrange(2), version)
                episodes.append(episode(i, oldest, newest, size=3))
            buffer.add(episodes)
            count += groups * 3
        else:
            version = max(0, version + rng.choice([1, 1, 1, 0, -2]))  # -2: a trainer restart
            batch = buffer.sample(version)
            if batch is not None:
                assert len(group_ids(batch)) == 2
                assert all(0 <= version - e.policy_version <= 1 for r in batch for e in r)
                trained += 6
        stats = buffer.stats()
        assert stats["added"] == stats["size"] + left(stats) == count
        assert stats["size"] == 3 * stats["groups"]
    stats = buffer.stats()
    assert stats["sampled"] == trained > 0
    assert stats["evicted_stale"] > stats["evicted_newer"] > 0 and stats["evicted_capacity"] > 0
    evicted = stats["evicted_stale"] + stats["evicted_capacity"]
    assert stats["groups_dropped"] * 3 == evicted


@pytest.mark.parametrize("codec", [json, pickle])
def test_state_dict_round_trip_resumes_with_the_same_next_sample(codec):
    cfg = ReplayBufferConfig(capacity=32, batch_size=4, dp_size=2, sampling="random", max_reuse=2)
    buffer = EpisodeBuffer(cfg)
    buffer.add([episode(i, version=i // 2 % 3) for i in range(20)])
    buffer.sample(2)
    resumed = EpisodeBuffer(cfg)
    resumed.load_state_dict(codec.loads(codec.dumps(buffer.state_dict())))
    assert resumed.stats() == buffer.stats()
    assert resumed.state_dict() == buffer.state_dict()
    # The groups and their size came back too: a buffered group or another size is refused.
    with pytest.raises(ValueError, match="group 'g8' is already in the buffer"):
        resumed.add([episode(16), episode(17)])
    with pytest.raises(ValueError, match="has 1 episodes, the buffer's groups have 2"):
        resumed.add([episode(99, size=1)])
    for _ in range(3):
        assert resumed.sample(3) == buffer.sample(3)
    assert resumed.state_dict() == buffer.state_dict()


def test_loading_into_a_smaller_buffer_evicts_the_oldest_groups():
    big = make(capacity=8)
    big.add([episode(i) for i in range(8)])
    small = make(capacity=5)
    small.load_state_dict(big.state_dict())
    assert (small.stats()["evicted_capacity"], small.stats()["groups_dropped"]) == (4, 2)
    assert ids(small.sample(0)) == [["e4", "e5", "e6", "e7"]]


def test_loading_groups_that_do_not_fit_the_batch_size_is_refused():
    buffer = make(batch_size=4)
    buffer.add([episode(i, size=4) for i in range(4)])
    with pytest.raises(ValueError, match="batch_size 6 is not a multiple of the group size 4"):
        make(batch_size=6).load_state_dict(buffer.state_dict())


def test_clear_starts_over():
    buffer = make(sampling="random")
    fresh = make(sampling="random")
    buffer.add([episode(i) for i in range(8)])
    buffer.sample(0)
    buffer.clear()
    assert buffer.stats() == fresh.stats()
    buffer.add([episode(i, size=4) for i in range(8)])  # the group size is forgotten too
    fresh.add([episode(i, size=4) for i in range(8)])
    assert buffer.sample(0) == fresh.sample(0)
