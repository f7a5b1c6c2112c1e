"""EpisodeBuffer: ordering, shaping, staleness, capacity, reuse, resume and stats."""

import json
import pickle

import pytest

from forge.actors.replay_buffer import EpisodeBuffer, ReplayBufferConfig
from forge.config import ConfigError, load_config
from forge.data import Completion, Episode


def episode(i: int, version: int = 0) -> Episode:
    """Episode `e{i}` whose oldest token is from `version` (its last token is one newer)."""
    completion = Completion([1, 2], [3, 4], "ab", [-0.5, -0.25], [version, version + 1], "stop")
    return Episode(f"e{i}", f"g{i // 4}", completion, reward=float(i), rewards={"math": 1.0})


def ids(batch: list[list[Episode]]) -> list[list[str]]:
    return [[e.episode_id for e in rank] for rank in batch]


def make(**overrides) -> EpisodeBuffer:
    return EpisodeBuffer(ReplayBufferConfig(**{"capacity": 64, "batch_size": 4, **overrides}))


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
    with pytest.raises(ConfigError, match="multiple of dp_size 4"):
        load_config(ReplayBufferConfig, None, ["batch_size=6", "dp_size=4"])
    with pytest.raises(ConfigError, match="sampling"):
        load_config(ReplayBufferConfig, None, ["sampling=lifo"])


def test_fifo_hands_out_oldest_first_and_each_episode_once():
    buffer = make()
    buffer.add([episode(i) for i in range(10)])
    assert ids(buffer.sample(0)) == [["e0", "e1", "e2", "e3"]]
    assert ids(buffer.sample(0)) == [["e4", "e5", "e6", "e7"]]
    assert buffer.sample(0) is None  # two left


def test_batch_is_split_evenly_over_dp_ranks_in_order():
    buffer = make(batch_size=6, dp_size=3)
    buffer.add([episode(i) for i in range(15)])
    assert ids(buffer.sample(0)) == [["e0", "e1"], ["e2", "e3"], ["e4", "e5"]]
    assert ids(buffer.sample(0, batch_size=9)) == [
        ["e6", "e7", "e8"],
        ["e9", "e10", "e11"],
        ["e12", "e13", "e14"],
    ]
    with pytest.raises(ValueError, match="multiple of dp_size 3, got 4"):
        buffer.sample(0, batch_size=4)


def test_random_sampling_is_determined_by_the_seed():
    def draws(seed: int) -> list[list[list[str]]]:
        buffer = make(sampling="random", seed=seed, max_reuse=3)
        buffer.add([episode(i) for i in range(12)])
        return [ids(buffer.sample(0)) for _ in range(5)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    fifo = [[f"e{i}" for i in range(4)]]
    assert any(batch != fifo for batch in draws(7))


def test_not_enough_fresh_episodes_gives_none_and_takes_nothing():
    buffer = make()
    buffer.add([episode(i) for i in range(3)])
    assert buffer.sample(0) is None
    assert buffer.stats()["size"] == 3 and buffer.stats()["sampled"] == 0
    buffer.add([episode(3)])
    assert ids(buffer.sample(0)) == [["e0", "e1", "e2", "e3"]]


def test_stale_boundary_keeps_age_equal_to_max_and_evicts_one_older():
    buffer = make(batch_size=2, max_policy_age=2)
    buffer.add([episode(0, version=2), episode(1, version=3), episode(2, version=3)])
    batch = buffer.sample(curr_policy_version=5)  # ages 3, 2, 2
    assert ids(batch) == [["e1", "e2"]]
    assert buffer.stats()["evicted_stale"] == 1


def test_sync_mode_trains_only_on_the_current_version():
    buffer = make(batch_size=2, max_policy_age=0)
    buffer.add([episode(0, version=4), episode(1, version=5), episode(2, version=5)])
    assert ids(buffer.sample(5)) == [["e1", "e2"]]
    assert buffer.stats()["evicted_stale"] == 1
    buffer.add([episode(3, version=5), episode(4, version=5)])
    assert buffer.sample(6) is None  # both one version old now
    assert buffer.stats()["evicted_stale"] == 3


def test_full_buffer_evicts_the_oldest_and_counts_them():
    buffer = make(capacity=4, batch_size=4)
    buffer.add([episode(i) for i in range(3)])
    buffer.add([episode(i) for i in range(3, 6)])
    assert buffer.stats()["size"] == 4 and buffer.stats()["evicted_capacity"] == 2
    assert ids(buffer.sample(0)) == [["e2", "e3", "e4", "e5"]]


def test_reuse_cap_retires_an_episode_after_its_last_batch():
    buffer = make(batch_size=2, max_reuse=2)
    buffer.add([episode(i) for i in range(4)])
    assert ids(buffer.sample(0)) == ids(buffer.sample(0)) == [["e0", "e1"]]
    assert ids(buffer.sample(0)) == [["e2", "e3"]]
    stats = buffer.stats()
    assert (stats["size"], stats["sampled"], stats["reused"], stats["retired"]) == (2, 6, 2, 2)


def test_empty_completion_is_refused():
    empty = Episode("e9", "g9", Completion([1], [], "", [], [], "abort"))
    with pytest.raises(ValueError, match="episode e9 has no policy version"):
        make().add([empty])


def test_stats_report_totals_and_ages_of_the_last_batch():
    buffer = make(capacity=6, batch_size=3, max_policy_age=3)
    assert buffer.stats()["policy_age_mean"] is None
    buffer.add([episode(i, version=v) for i, v in enumerate([0, 4, 5, 6, 6, 6, 6])])
    buffer.sample(curr_policy_version=6)  # e0 evicted for capacity; ages of e1..e3: 2, 1, 0
    stats = buffer.stats()
    assert stats == {
        "size": 3,
        "added": 7,
        "sampled": 3,
        "reused": 0,
        "retired": 3,
        "evicted_stale": 0,
        "evicted_capacity": 1,
        "policy_age_min": 0,
        "policy_age_mean": 1.0,
        "policy_age_max": 2,
    }
    left = stats["retired"] + stats["evicted_stale"] + stats["evicted_capacity"]
    assert stats["added"] == stats["size"] + left


@pytest.mark.parametrize("codec", [json, pickle])
def test_state_dict_round_trip_resumes_with_the_same_next_sample(codec):
    cfg = ReplayBufferConfig(capacity=32, batch_size=4, dp_size=2, sampling="random", max_reuse=2)
    buffer = EpisodeBuffer(cfg)
    buffer.add([episode(i, version=i % 3) for i in range(20)])
    buffer.sample(2)
    resumed = EpisodeBuffer(cfg)
    resumed.load_state_dict(codec.loads(codec.dumps(buffer.state_dict())))
    assert resumed.stats() == buffer.stats()
    for _ in range(3):
        assert resumed.sample(3) == buffer.sample(3)
    assert resumed.state_dict() == buffer.state_dict()


def test_loading_into_a_smaller_buffer_evicts_the_oldest():
    big = make(capacity=8)
    big.add([episode(i) for i in range(8)])
    small = make(capacity=5)
    small.load_state_dict(big.state_dict())
    assert small.stats()["evicted_capacity"] == 3
    assert ids(small.sample(0)) == [["e3", "e4", "e5", "e6"]]


def test_clear_starts_over():
    buffer = make(sampling="random")
    fresh = make(sampling="random")
    buffer.add([episode(i) for i in range(8)])
    buffer.sample(0)
    buffer.clear()
    assert buffer.stats() == fresh.stats()
    buffer.add([episode(i) for i in range(8)])
    fresh.add([episode(i) for i in range(8)])
    assert buffer.sample(0) == fresh.sample(0)
