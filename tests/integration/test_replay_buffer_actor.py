"""The ReplayBuffer actor in a real Monarch process: episodes cross the boundary by pickling."""

import asyncio
import os

import pytest
from monarch.actor import ActorError

from forge.actors.buffer import ReplayBuffer, ReplayBufferConfig
from forge.controller import shutdown
from forge.data import Completion, Episode

pytestmark = pytest.mark.integration


def episode(i: int, version: int) -> Episode:
    completion = Completion([1, 2], [3, 4], "ab", [-0.5, -0.25], [version, version], "stop")
    return Episode(f"e{i}", f"g{i // 2}", completion, reward=1.0, ref_logprobs=[-0.4, -0.3])


@pytest.fixture
async def buffer():
    cfg = ReplayBufferConfig(capacity=16, batch_size=4, dp_size=2, max_policy_age=1)
    yield await ReplayBuffer.as_actor(cfg)
    await shutdown()


async def test_add_sample_stats_and_resume_across_the_process_boundary(buffer):
    assert await buffer.ping.call_one() != os.getpid()
    sent = [episode(i, version=i // 4) for i in range(12)]  # versions 0, 1, 2
    await buffer.add.call_one(sent)
    assert (await buffer.sample.call_one(curr_policy_version=2, batch_size=10)).batch is None

    state = await buffer.state_dict.call_one()
    batch = (await buffer.sample.call_one(curr_policy_version=2)).batch
    assert batch == [sent[4:6], sent[6:8]]  # versions 1 and 2 only; equal after the round trip

    stats = await buffer.stats.call_one()
    assert (stats["size"], stats["evicted_stale"], stats["sampled"]) == (4, 4, 4)
    assert (stats["groups"], stats["groups_dropped"]) == (2, 2)  # whole groups of 2
    assert (stats["policy_age_min"], stats["policy_age_max"]) == (1, 1)

    await buffer.clear.call_one()
    assert (await buffer.stats.call_one())["added"] == 0
    await buffer.load_state_dict.call_one(state)
    assert (await buffer.sample.call_one(curr_policy_version=2)).batch == batch


async def test_errors_reach_the_caller_and_the_actor_keeps_serving(buffer):
    empty = Episode("e0", "g0", Completion([1], [], "", [], [], "abort"))
    with pytest.raises(ActorError, match="episode e0 has no policy version"):
        await buffer.add.call_one([empty])
    with pytest.raises(ActorError, match="multiple of dp_size 2, got 3"):
        await buffer.sample.call_one(curr_policy_version=0, batch_size=3)
    await buffer.add.call_one([episode(0, version=0), episode(1, version=0)])
    with pytest.raises(ActorError, match="group 'g0' is already in the buffer"):
        await buffer.add.call_one([episode(1, version=0)])
    await buffer.add.call_one([episode(i, version=0) for i in range(2, 4)])
    assert len((await buffer.sample.call_one(curr_policy_version=0)).batch) == 2


async def test_sample_waits_for_a_batch_and_returns_early_when_groups_are_evicted(buffer):
    waiting = asyncio.ensure_future(buffer.sample.call_one(curr_policy_version=1, wait_s=120))
    await buffer.add.call_one([episode(i, version=1) for i in range(2)])  # half a batch
    assert not waiting.done()
    await buffer.add.call_one([episode(i, version=1) for i in range(2, 4)])
    sampled = await waiting  # the second group made a batch: the wait ends with it
    assert [e.episode_id for rank in sampled.batch for e in rank] == ["e0", "e1", "e2", "e3"]
    assert (sampled.stats["size"], sampled.left) == (0, 4)  # retired after its one use

    # Version 3 makes the group of version 1 stale: evicted at once, and the caller is told
    # (its count of what is buffered is too high) although no batch is ready.
    await buffer.add.call_one([episode(i, version=1) for i in range(4, 6)])
    sampled = await buffer.sample.call_one(curr_policy_version=3, wait_s=120, known_left=4)
    assert sampled.batch is None and sampled.left == 6
    assert sampled.stats["evicted_stale"] == 2

    # Without a batch or an eviction it waits its wait_s out, and says so without a batch.
    sampled = await buffer.sample.call_one(curr_policy_version=3, wait_s=0.2, known_left=6)
    assert sampled.batch is None and sampled.left == 6
