"""Episodes per second and tool-call latency of environments behind EnvironmentActor replicas
(1, 2, 4), against the same environments in the caller's process (the simplest alternative).

Each episode is `ToolTask` with the python tool (each call a sandboxed interpreter): turn one
runs a short computation in the sandbox, turn two answers. The turns are scripted, so what is
measured is the environments' side of a rollout, not the model's.

    python bench/environments.py [--episodes 32]
"""

import argparse
import asyncio
import json
import statistics
import time

from library_log import library_output_to_log
from result import Result
from transformers import AutoTokenizer

from forge.actors.environment import EnvironmentActor, RemoteEnvironment
from forge.controller import shutdown
from forge.data import Completion
from forge.data.chat import ChatBridge
from forge.envs.config import EnvConfig
from forge.envs.runner import EpisodeLimits, EpisodeOutcome, play
from forge.envs.tasks import ToolTask
from forge.models import smollm2
from forge.observability.console import say

CODE = "print(sum(i * i for i in range(300_000)))"
ANSWER = str(sum(i * i for i in range(300_000)))
ROW = {
    "question": "Sum of squares below 300000?",
    "answer": ANSWER,
    "prompt": [{"role": "user", "content": "Sum of squares below 300000?"}],
}
TASK = {"tools": ["python"]}
LIMITS = EpisodeLimits(max_turns=2, step_timeout_s=60.0)


class Timed:
    """An environment whose tool steps are timed (the environment's own step, end to end)."""

    def __init__(self, env, latencies: list[float]) -> None:
        self.env, self.latencies = env, latencies

    async def reset(self):
        return await self.env.reset()

    async def step(self, text: str):
        start = time.perf_counter()
        result = await self.env.step(text)
        if not result.done:
            self.latencies.append(time.perf_counter() - start)
        return result

    async def close(self):
        await self.env.close()


def scripted(bridge: ChatBridge):
    tokenizer = bridge.tokenizer
    call = json.dumps({"name": "python", "arguments": {"code": CODE}})
    turns = [f"<tool_call>{call}</tool_call>", f"<answer>{ANSWER}</answer>"]

    async def sample(context: list[int], max_tokens: int | None) -> Completion:
        text = turns[tokenizer.decode(context).count("<|im_start|>assistant") - 1]
        ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        return Completion(context, ids, text, [0.0] * len(ids), [0] * len(ids), "stop")

    return sample


def answered(outcome: EpisodeOutcome) -> bool:
    """The episode's one tool call ran without error, and its answer ended it."""
    calls, errors = outcome.metrics["tool_calls"], outcome.metrics["tool_errors"]
    return outcome.status == "done" and (calls, errors) == (1, 0)


async def run(make_env, episodes: int, bridge: ChatBridge) -> tuple[float, float]:
    """Episodes per second and p50 tool-step latency (ms) of `episodes` concurrent episodes."""
    latencies: list[float] = []

    async def one(i: int) -> float:
        make = lambda: Timed(make_env(i), latencies)  # noqa: E731
        outcome = await play(make, bridge, scripted(bridge), LIMITS)
        assert answered(outcome), outcome
        return outcome

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(episodes)))
    return episodes / (time.perf_counter() - start), 1000 * statistics.median(latencies)


async def served(replicas: int, episodes: int, bridge: ChatBridge) -> tuple[float, float]:
    envs = await EnvironmentActor.options(num_replicas=replicas).as_service(
        EnvConfig("forge.envs.tasks:ToolTask", TASK)
    )

    def make(i: int) -> RemoteEnvironment:
        return RemoteEnvironment(envs, f"e{i}", ROW)

    async def in_session(i: int):  # each episode sticks to one replica
        async with envs.session():
            return await play(lambda: Timed(make(i), latencies), bridge, scripted(bridge), LIMITS)

    latencies: list[float] = []
    await asyncio.gather(*(in_session(i) for i in range(replicas)))  # warm up
    latencies.clear()
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(in_session(i) for i in range(episodes)))
    rate = episodes / (time.perf_counter() - start)
    assert all(map(answered, outcomes))
    await shutdown()
    return rate, 1000 * statistics.median(latencies)


async def main(episodes: int) -> None:
    bridge = ChatBridge(AutoTokenizer.from_pretrained(smollm2()))
    local = await run(lambda i: ToolTask(ROW, **TASK), episodes, bridge)
    say(f"in process: {local[0]:.2f} episodes/s, tool step p50 {local[1]:.0f} ms")
    result = Result("environments")
    result.figure("episodes/s, in process", local[0], "episodes/s")
    result.figure("tool step p50, in process", local[1], "ms")
    for replicas in (1, 2, 4):
        rate, p50 = await served(replicas, episodes, bridge)
        say(
            f"{replicas} replica(s): {rate:.2f} episodes/s ({rate / local[0]:.2f}x in process), "
            f"tool step p50 {p50:.0f} ms"
        )
        result.figure(f"episodes/s, {replicas} replica(s)", rate, "episodes/s")
        result.figure(f"tool step p50, {replicas} replica(s)", p50, "ms")
        result.ratio(f"{replicas} replica(s) / in process, episodes/s", rate / local[0])
    result.write()


if __name__ == "__main__":
    library_output_to_log("environments")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    asyncio.run(main(parser.parse_args().episodes))
