"""Multi-turn episodes on a real vLLM generator and a real torchtitan trainer (a tiny model):
the turns are sampled from the trajectory's own token ids, a weight update in `inflight` mode
lands between two turns and the versions show it, the trainer scores every sampled token as
the generator did (mismatch KL), and a train step takes a multi-turn trajectory."""

import pytest
import torch
from transformers import AutoTokenizer

from forge.actors.generator import Generator, GeneratorConfig
from forge.actors.trainer import OptimizerConfig, TitanTrainer, TrainerConfig
from forge.controller import shutdown
from forge.data import Episode
from forge.data.chat import ChatBridge
from forge.envs.environment import StepResult
from forge.envs.runner import EpisodeLimits, run_episode
from forge.losses import mismatch_kl
from forge.models import tiny_model
from forge.weights.sync_config import WeightSyncConfig
from forge.weights.transport import TransportConfig

pytestmark = pytest.mark.integration

LIMITS = EpisodeLimits(max_turns=3, max_tokens=60)
TURN_TOKENS = 16


class Counting:
    """Answers each turn with a tool message counting its characters; ends after three."""

    def __init__(self):
        self.turns = 0

    async def reset(self):
        return [{"role": "user", "content": "Say something, three times."}]

    async def step(self, text):
        self.turns += 1
        if self.turns == 3:
            return StepResult(done=True, reward=1.0)
        return StepResult([{"role": "tool", "content": f"{len(text)} characters"}])

    async def close(self):
        pass


@pytest.fixture
async def actors(tmp_path):
    model = str(tiny_model("llama", seed=0, init_std=0.5))
    sync = WeightSyncConfig(TransportConfig(path=str(tmp_path / "w")))
    trainer = await TitanTrainer.as_actor(
        TrainerConfig(model=model, optimizer=OptimizerConfig(lr=1e-3)), sync
    )
    generator = await Generator.options(env={"OMP_NUM_THREADS": "1"}).as_actor(
        GeneratorConfig(model=model, max_model_len=512, kv_cache_mb=32), sync
    )
    yield trainer, generator, ChatBridge(AutoTokenizer.from_pretrained(model))
    await shutdown()


def sampler(generator, before_turn=None):
    turns = 0

    async def sample(context, max_tokens):
        nonlocal turns
        turns += 1
        if before_turn:
            await before_turn(turns)
        (completion,) = await generator.generate.call_one(
            context, sampling={"max_tokens": min(max_tokens, TURN_TOKENS)}
        )
        return completion

    return sample


async def mismatch(trainer, completion, version: int) -> float:
    """Trainer vs generator KL over the sampled tokens of `version`."""
    (ours,) = await trainer.compute_logprobs.call_one(
        [(completion.prompt_ids, completion.token_ids)]
    )
    keep = torch.tensor(
        [
            m == 1 and v == version
            for m, v in zip(completion.mask, completion.token_versions, strict=True)
        ]
    )
    assert keep.any()
    kl, _ = mismatch_kl(torch.tensor(ours), torch.tensor(completion.logprobs), keep)
    return float(kl)


async def test_turns_an_inflight_update_between_them_and_the_trainer_s_view_of_them(actors):
    trainer, generator, bridge = actors
    first = await run_episode(Counting(), bridge, sampler(generator), LIMITS)
    assert (first.status, first.trajectory.turns) == ("done", 3)
    one = first.trajectory.completion()
    assert set(one.token_versions) == {0} and 0 < sum(one.mask) < len(one.mask)
    kl_v0 = await mismatch(trainer, one, 0)

    # The multi-turn trajectory trains; its weights become version 1.
    metrics = await trainer.train_step.call_one([[Episode("e0", "g0", one, advantage=1.0)]])
    assert metrics["loss"] != 0
    await trainer.push_weights.call_one(1)

    async def update_before_turn_2(turn: int) -> None:
        if turn == 2:
            await generator.update_weights.call_one(1, mode="inflight")

    second = await run_episode(Counting(), bridge, sampler(generator, update_before_turn_2), LIMITS)
    two = second.trajectory.completion()
    sampled = [v for v, m in zip(two.token_versions, two.mask, strict=True) if m]
    turn_1 = two.mask.index(0)  # the first observation token ends turn 1
    assert set(sampled[:turn_1]) == {0} and set(sampled[turn_1:]) == {1}
    assert two.policy_version == 0
    kl_v1 = await mismatch(trainer, two, 1)
    print(f"multi-turn mismatch KL: version 0 {kl_v0:.2e}, version 1 {kl_v1:.2e}")
    assert kl_v0 < 1e-3 and kl_v1 < 1e-3
