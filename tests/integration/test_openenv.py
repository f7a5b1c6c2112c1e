"""An OpenEnv environment runs unchanged as a forge environment: the echo environment that
`openenv init` writes from the template inside openenv-core (no Docker, no network), driven
turn by turn in process and behind an EnvironmentActor service."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from forge.actors.environment import EnvironmentActor, RemoteEnvironment
from forge.controller import shutdown
from forge.data import Completion
from forge.data.chat import ChatBridge
from forge.envs.config import EnvConfig
from forge.envs.openenv import OpenEnvTask
from forge.envs.runner import EpisodeLimits, play, run_episode
from forge.models import smollm2

pytestmark = pytest.mark.integration

ECHO = "echo_env.server.echo_env_environment:EchoEnvironment"


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory) -> Path:
    """A folder holding the echo environment as `openenv init echo_env` writes it."""
    folder = tmp_path_factory.mktemp("openenv")
    openenv = Path(sys.executable).parent / "openenv"
    subprocess.run([openenv, "init", "echo_env"], cwd=folder, check=True, capture_output=True)
    return folder


@pytest.fixture
def importable(echo_env, monkeypatch):
    """The echo environment importable here and in the processes the test starts."""
    monkeypatch.syspath_prepend(str(echo_env))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(echo_env), os.environ["PYTHONPATH"]]))


def scripted(bridge: ChatBridge, turns: list[str]):
    tokenizer, texts = bridge.tokenizer, iter(turns)

    async def sample(context: list[int], max_tokens: int | None) -> Completion:
        text = next(texts)
        ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        return Completion(context, ids, text, [-0.1] * len(ids), [0] * len(ids), "stop")

    return sample


@pytest.fixture(scope="module")
def bridge() -> ChatBridge:
    return ChatBridge(AutoTokenizer.from_pretrained(smollm2()))


async def test_the_echo_environment_step_by_step(importable):
    task = OpenEnvTask({"index": 0}, ECHO)
    (first,) = await task.reset()
    observation, how = first["content"].split("\n")
    assert observation == '{"echoed_message": "Echo Env environment ready!", "message_length": 0}'
    assert how.endswith('{"message": "string: Message to echo back"}.')  # for the model
    step = await task.step('{"message": "Hello"}')
    assert step.messages == [
        {"role": "user", "content": '{"echoed_message": "Hello", "message_length": 5}'}
    ]
    assert (step.done, step.reward) == (False, pytest.approx(0.5))
    plain = await task.step("forge drives the turns")  # one required field: the text itself
    assert '"message_length": 22' in plain.messages[0]["content"]
    bad = await task.step('{"text": "Hello"}')
    assert bad.messages[0]["content"] == (
        "error: not a valid EchoAction: message: Field required; "
        "text: Extra inputs are not permitted"
    )
    assert (bad.reward, bad.metrics) == (0.0, {"malformed_actions": 1})
    await task.close()


async def test_an_echo_episode_in_process_and_behind_a_service(importable, bridge):
    turns = ['{"message": "ab"}', "abcd", '{"message": 3}']
    limits = EpisodeLimits(max_turns=3)
    outcome = await run_episode(OpenEnvTask({}, ECHO), bridge, scripted(bridge, turns), limits)
    assert (outcome.status, outcome.trajectory.turns) == ("max_turns", 3)
    assert outcome.reward == pytest.approx(0.2 + 0.4)  # the malformed third turn earns nothing
    assert outcome.metrics["malformed_actions"] == 1
    try:
        envs = await EnvironmentActor.as_service(
            EnvConfig("forge.envs.openenv:OpenEnvTask", {"environment": ECHO})
        )
        async with envs.session():
            make = lambda: RemoteEnvironment(envs, "e0", {})  # noqa: E731
            served = await play(make, bridge, scripted(bridge, turns), limits)
    finally:
        await shutdown()
    assert served.reward == pytest.approx(outcome.reward)
    assert served.trajectory.token_ids == outcome.trajectory.token_ids
