"""The cost of rolling out single-turn GRPO through the environment interface: a batch of
`make grpo`'s rollouts (SmolLM2-135M, its data, group size, sampling and reward functions) as
episodes (forge.loop.rollouts: the row's environment, one generate call per episode, the
reward service on each answer), against the simplest alternative, the path forge had before
episodes: one generate call for the group's n samples, the reward service on their texts.

Both run on the same generator and reward service, batches alternating so that drift in the
machine's speed falls on both; both sample with the same seeds, and the bench reports whether
they drew the same tokens (vLLM seeds the i-th of n samples with seed + i, as the episodes'
first turns are seeded). The rollout phase is at most a step's time, so its ratio bounds the
s/step ratio of a run.

    python bench/episode_rollouts.py [--batches 10]
"""

import argparse
import asyncio
import statistics
import time

from library_log import library_output_to_log
from result import ROOT, Result

from forge.actors.generator import Generator
from forge.actors.reward import RewardActor
from forge.cli import load_app
from forge.config import load_config
from forge.controller import shutdown
from forge.data.chat import ChatBridge
from forge.data.datasets import open_dataset
from forge.envs.config import EnvConfig
from forge.loop.generator_handle import GeneratorHandle
from forge.loop.rollouts import Rollouts
from forge.models import load_tokenizer
from forge.observability.console import say

CONFIG = ROOT / "configs" / "grpo" / "smollm2_cpu.yaml"


async def main(batches: int) -> None:
    cfg = load_config(load_app(ROOT / "apps" / "grpo" / "main.py")[1], CONFIG)
    data = open_dataset(cfg.data)
    groups = cfg.buffer.batch_size // cfg.group_size
    service = await Generator.options(num_replicas=1).as_service(cfg.generator, cfg.weight_sync)
    reward = await RewardActor.options(num_replicas=1).as_service(cfg.reward)
    generator = GeneratorHandle(service)
    bridge = ChatBridge(load_tokenizer(cfg.generator.model))
    turn, context = cfg.generator.sampling.max_tokens, cfg.generator.max_model_len
    episodes = Rollouts(EnvConfig(), generator, bridge, turn, context, reward=reward)

    async def direct(row: dict, seed: int) -> list[list[int]]:
        completions = await generator.generate(row["prompt"], cfg.group_size, {"seed": seed})
        await reward.evaluate.route([row] * len(completions), [c.text for c in completions])
        return [c.token_ids for c in completions]

    async def as_episodes(row: dict, seed: int) -> list[list[int]]:
        outcomes = await episodes.play(row, cfg.group_size, seed=seed)
        await episodes.score([row] * len(outcomes), outcomes)
        return [o.trajectory.token_ids for o in outcomes]

    async def batch(path, b: int) -> tuple[float, list]:
        rows = [data.nth(b * groups + g) for g in range(groups)]
        start = time.perf_counter()
        tokens = await asyncio.gather(*(path(r, b * 1000 + i) for i, r in enumerate(rows)))
        return time.perf_counter() - start, tokens

    await batch(direct, batches)  # warm-up, on rows the measured batches do not use
    times: dict[str, list[float]] = {"direct": [], "episodes": []}
    same = True
    for b in range(batches):
        t_direct, tokens_direct = await batch(direct, b)
        t_episodes, tokens_episodes = await batch(as_episodes, b)
        times["direct"].append(t_direct)
        times["episodes"].append(t_episodes)
        same &= tokens_direct == tokens_episodes
        say(f"batch {b + 1}: one call per group {t_direct:.2f} s, episodes {t_episodes:.2f} s")
    await shutdown()

    medians = {path: statistics.median(ts) for path, ts in times.items()}
    ratio = medians["episodes"] / medians["direct"]
    say(
        f"rollout s/batch (median of {batches}): episodes {medians['episodes']:.2f}, one call per "
        f"group {medians['direct']:.2f}: {ratio:.3f}x; same tokens sampled: {same}"
    )
    result = Result("episode_rollouts")
    result.figure("rollout s/batch, episodes", medians["episodes"], "s")
    result.figure("rollout s/batch, one generate call per group", medians["direct"], "s")
    result.ratio("episodes / one call per group, rollout s/batch", ratio, target="<= 1.05")
    result.figure("same tokens sampled (1 = yes)", float(same), "flag")
    result.write()


if __name__ == "__main__":
    library_output_to_log("episode_rollouts")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10)
    asyncio.run(main(parser.parse_args().batches))
