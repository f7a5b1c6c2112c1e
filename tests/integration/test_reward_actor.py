"""RewardActor on a real Monarch process: failing, hanging and correct reward functions."""

import asyncio
import sys
from pathlib import Path

import cloudpickle
import pytest
from helper_runs import wait_until
from monarch.actor import ActorError

from forge.actors.reward import RewardActor, RewardConfig
from forge.controller import shutdown
from forge.data.datasets import ReasoningGymDataset, easy_arithmetic

pytestmark = pytest.mark.integration

# The test reward functions below travel by value to the actor and on to its worker processes,
# which cannot import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMEOUT_S = 1.0


def exact(row, text):
    return 1.0 if text.strip() == row["answer"] else 0.0


def boom(row, text):
    raise ValueError("boom: the reward function has a bug")


def stall(row, text):
    if "stall" in text:
        Path(row["stall_marker"]).touch()  # tells the test it now spins
        while True:  # pure Python: no await, no signal handler will ever run
            pass
    return 0.5


async def test_raising_and_hanging_functions_score_zero_and_are_counted(tmp_path):
    row = next(ReasoningGymDataset(easy_arithmetic(size=10)))
    right = row["answer"]
    config = RewardConfig(
        functions=["exact", "boom", "stall", "reasoning_gym"],
        weights={"reasoning_gym": 2.0},
        timeout_s=TIMEOUT_S,
        num_workers=2,  # one serves while the other, killed after the hang, restarts
    )
    custom = {"exact": exact, "boom": boom, "stall": stall}
    try:
        actor = await RewardActor.options(procs=1).as_actor(config, custom)

        marker = tmp_path / "stalling"
        stalling = {**row, "stall_marker": str(marker)}
        scoring = asyncio.ensure_future(
            actor.evaluate.call_one([row, stalling], [right, f"stall <answer>{right}</answer>"])
        )
        await wait_until(marker.exists, "the stall function spinning")
        # The actor answers while a reward function spins in its worker: before the call
        # waiting on that function has given up on it.
        await actor.ping.call_one()
        assert not scoring.done()
        async with asyncio.timeout(60):  # the reward deadline ends it; this guards a stall
            first, second = await scoring

        assert first.rewards == {"exact": 1.0, "boom": 0.0, "stall": 0.5, "reasoning_gym": 1.0}
        assert first.failed == ["boom"] and first.reward == 1.0 + 0.5 + 2.0
        assert second.rewards == {"exact": 0.0, "boom": 0.0, "stall": 0.0, "reasoning_gym": 1.0}
        assert sorted(second.failed) == ["boom", "stall"] and second.reward == 2.0

        # The next call scores right and costs no timeout (still one counted, below).
        [third] = await actor.evaluate.call_one([row], [right])
        assert third.rewards["exact"] == 1.0 and third.rewards["stall"] == 0.5

        stats = await actor.stats.call_one()
        assert stats["errors"] == {"boom": 3} and stats["timeouts"] == {"stall": 1}
        assert stats["failures"] == 4 and stats["worker_restarts"] == 1
        assert stats["calls"] == 12
    finally:
        await shutdown()


async def test_unknown_function_fails_setup():
    try:
        with pytest.raises(ActorError, match="unknown reward function 'nope'"):
            await RewardActor.options(procs=1).as_actor(RewardConfig(functions=["nope"]))
    finally:
        await shutdown()


def test_config_is_checked():
    with pytest.raises(ValueError, match=r"weights: \['math'\] not in functions"):
        RewardConfig(functions=["math_verify"], weights={"math": 1.0})
    with pytest.raises(ValueError, match="names a function twice"):
        RewardConfig(functions=["format", "format"])
