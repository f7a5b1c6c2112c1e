"""GRPO, asynchronous by default: rollouts and training run at once, bounded in staleness.

    forge run apps/grpo/main.py --config configs/grpo/smollm2_cpu.yaml [key=value ...]

The loop (rollout workers behind the admission gate, train, publish, eval) is forge.loop's;
what makes it GRPO is `score`: each completion is rewarded, rewards are normalised within the
prompt's group into advantages, and (with a KL term) a reference model scores the tokens.
"""

from dataclasses import dataclass

import torch

from forge.actors.reference import ReferenceConfig, ReferenceModel
from forge.data import Completion, Episode
from forge.loop import RLConfig, RLLoop
from forge.losses import group_advantages
from forge.observability import Reduce, record_metric
from forge.placement.roles import Role


@dataclass
class Config(RLConfig):
    run_dir: str = "runs/grpo"
    reference: ReferenceConfig | None = None  # needed when trainer.loss.kl_coef > 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.trainer.loss.kl_coef > 0 and self.reference is None:
            raise ValueError("trainer.loss.kl_coef > 0 needs a reference model config")

    def scores(self) -> bool:
        return True  # every rollout

    def roles(self) -> list[Role]:
        if self.reference is None:
            return super().roles()
        return [*super().roles(), Role("reference", ReferenceModel, (self.reference,))]


class GRPO(RLLoop):
    """Rewards, group advantages and (optionally) reference logprobs for each group."""

    cfg: Config
    plot_keys = ("rollout/reward", "eval/reward", "train/mismatch_kl", "generator/tokens_per_s")

    async def attach(self, actors: dict) -> None:
        await super().attach(actors)
        self.reference = actors.get("reference")

    async def score(self, group: int, row: dict, completions: list[Completion]) -> list[Episode]:
        scores = await self.reward.evaluate.route(
            [row] * len(completions), [c.text for c in completions]
        )
        advantages = group_advantages(torch.tensor([s.reward for s in scores]))
        episodes = [
            Episode(f"{group}-{i}", str(group), c, s.reward, s.rewards, float(a))
            for i, (c, s, a) in enumerate(zip(completions, scores, advantages, strict=True))
        ]
        if self.reference is not None:
            pairs = [(c.prompt_ids, c.token_ids) for c in completions]
            for e, lp in zip(episodes, await self.reference.logprobs.call_one(pairs), strict=True):
                e.ref_logprobs = lp
        for s in scores:
            record_metric("rollout/reward", s.reward)
            record_metric("rollout/reward_std", s.reward, Reduce.STD)
            for name, value in s.rewards.items():
                record_metric(f"rollout/reward/{name}", value)
            record_metric("rollout/reward_failures", len(s.failed), Reduce.SUM)
        return episodes


async def main(cfg: Config) -> None:
    await GRPO(cfg).main()
