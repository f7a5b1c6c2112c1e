"""Environments behind a service of EnvironmentActor replicas (real processes): episodes are
sticky to the replica that opened them; a SIGKILLed replica's episodes restart from their first
turn on the other, none lost and none finished twice; a step that hangs ends its episode at
the step limit while the others finish. The turns are scripted (each guesses its turn number):
what is under test is the service, not the model (tests/integration/test_episodes.py has the
real generator)."""

import asyncio
import os
import signal

import pytest
from helper_runs import wait_until
from transformers import AutoTokenizer

from forge.actors.environment import EnvironmentActor, RemoteEnvironment
from forge.controller import shutdown
from forge.data import Completion
from forge.data.chat import ChatBridge
from forge.envs.config import EnvConfig
from forge.envs.runner import EpisodeLimits, play
from forge.models import smollm2

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bridge() -> ChatBridge:
    return ChatBridge(AutoTokenizer.from_pretrained(smollm2()))


def guessing(bridge: ChatBridge):
    """A sampler whose turn n answers "n"."""
    tokenizer = bridge.tokenizer

    async def sample(context: list[int], max_tokens: int | None) -> Completion:
        turn = tokenizer.decode(context).count("<|im_start|>assistant")
        ids = [*tokenizer.encode(str(turn), add_special_tokens=False), tokenizer.eos_token_id]
        return Completion(context, ids, str(turn), [-0.1] * len(ids), [0] * len(ids), "stop")

    return sample


async def episodes(envs, bridge, rows, limits):
    async def one(i: int, row: dict):
        async with envs.session():
            make = lambda: RemoteEnvironment(envs, f"e{i}", row)  # noqa: E731
            return await play(make, bridge, guessing(bridge), limits)

    return [asyncio.ensure_future(one(i, row)) for i, row in enumerate(rows)]


async def test_a_killed_replica_s_episodes_start_again_on_the_other(tmp_path, bridge):
    gate = tmp_path / "gate"  # every step waits for it: the kill comes mid-episode
    rows = [{"secret": 1 + i % 3} for i in range(8)]
    try:
        envs = await EnvironmentActor.options(num_replicas=2, health_interval_s=0.5).as_service(
            EnvConfig("helper_envs:Guess", {"gate": str(gate)})
        )
        victim, other = envs.replica_actors()
        running = await episodes(envs, bridge, rows, EpisodeLimits(max_turns=4))

        async def all_open() -> bool:
            return sum(await envs.episodes_open.fanout()) == len(rows)

        await wait_until(all_open, "every episode opened", timeout=60)
        lost = await victim.episodes_open.call_one()
        assert lost > 0 and await other.episodes_open.call_one() == len(rows) - lost
        os.kill(await victim.ping.call_one(), signal.SIGKILL)
        gate.touch()
        outcomes = await asyncio.gather(*running)
    finally:
        await shutdown()
    assert [o.status for o in outcomes] == ["done"] * len(rows)
    assert [o.trajectory.turns for o in outcomes] == [row["secret"] for row in rows]
    assert sum(o.metrics["restarts"] for o in outcomes) == lost  # each lost one, once


async def test_a_hanging_step_ends_its_episode_at_the_limit_and_the_others_finish(bridge):
    rows = [{"secret": 2}, {"secret": 1, "hang": True}, {"secret": 3}]
    try:
        envs = await EnvironmentActor.as_service(EnvConfig("helper_envs:Guess"))
        running = await episodes(envs, bridge, rows, EpisodeLimits(step_timeout_s=2.0))
        outcomes = await asyncio.gather(*running)
        left_open = await envs.episodes_open.fanout()
    finally:
        await shutdown()
    assert [o.status for o in outcomes] == ["done", "timeout", "done"]
    assert outcomes[1].metrics["timeouts"] == 1 and outcomes[1].reward == 0.0
    assert left_open == [0]  # the hung step was cancelled when its episode closed


async def test_a_factory_that_does_not_import_fails_the_start_in_one_line():
    with pytest.raises(Exception, match="cannot import environment factory 'helper_envs:Nope'"):
        await EnvironmentActor.as_service(EnvConfig("helper_envs:Nope"))
    await shutdown()


async def test_an_episode_opened_twice_is_refused_and_its_environment_kept():
    try:
        envs = await EnvironmentActor.as_service(EnvConfig("helper_envs:Guess"))
        await envs.open.route("e0", {"secret": 5})
        with pytest.raises(Exception, match="episode e0 is open already"):
            await envs.open.route("e0", {"secret": 6})
        step = await envs.step.route("e0", "5")  # still the first environment
        open_after = await envs.episodes_open.fanout()
    finally:
        await shutdown()
    assert step.done and open_after == [1]
