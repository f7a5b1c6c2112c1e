"""GRPO, asynchronous by default: rollouts and training run at once, bounded in staleness.

    forge run apps/grpo/main.py --config configs/grpo/smollm2_cpu.yaml [key=value ...]

The loop (rollout workers behind the admission gate, episodes of the run's environment, train,
publish, eval) is forge.loop's; what makes it GRPO is `score`: each episode's answer is
rewarded, rewards are normalised within the row's group into advantages, and (with a KL term) a
reference model scores the tokens.
"""

from dataclasses import dataclass

import torch

from forge.actors.reference import ReferenceConfig, ReferenceModel
from forge.data import Episode
from forge.envs.config import EnvConfig
from forge.envs.runner import EpisodeOutcome
from forge.loop import RLConfig, RLLoop, RunParts
from forge.losses import group_advantages
from forge.observability import Reduce, record_metric
from forge.placement.roles import Role


@dataclass
class Config(RLConfig):
    """RLConfig plus the reference model.

    Args:
        reference: the frozen model the KL term is taken to; needed when
            trainer.loss.kl_coef > 0, else None (no reference model runs).
    """

    run_dir: str = "runs/grpo"
    reference: ReferenceConfig | None = None

    OBJECTIVE = "grpo"
    REWARDS_ROLLOUTS = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.trainer.loss.kl_coef > 0 and self.reference is None:
            raise ValueError("trainer.loss.kl_coef > 0 needs a reference model config")
        if not self.reward.functions and self.env.factory == EnvConfig.factory:
            raise ValueError(
                "reward.functions is empty and env.factory (ToolTask) rewards nothing itself: "
                "every advantage would be 0"
            )

    def roles(self) -> list[Role]:
        if self.reference is None:
            return super().roles()
        # A service of one replica: a dead one is respawned, and `logprobs` retried on it.
        reference = Role("reference", ReferenceModel, (self.reference,), service=True)
        return [*super().roles(), reference]


class GRPO(RLLoop):
    """Rewards, group advantages and (optionally) reference logprobs for each group."""

    cfg: Config
    plot_keys = ("rollout/reward", "eval/reward", "train/mismatch_kl", "generator/tokens_per_s")

    def __init__(self, cfg: Config, parts: RunParts) -> None:
        super().__init__(cfg, parts)
        self.reference = parts.actors.get("reference")

    async def score(self, group: int, row: dict, outcomes: list[EpisodeOutcome]) -> list[Episode]:
        advantages = group_advantages(torch.tensor([o.reward for o in outcomes]))
        completions = [o.trajectory.completion() for o in outcomes]
        episodes = [
            Episode(f"{group}-{i}", str(group), c, o.reward, o.rewards, float(a))
            for i, (c, o, a) in enumerate(zip(completions, outcomes, advantages, strict=True))
        ]
        if self.reference is not None:
            pairs = [(c.prompt_ids, c.token_ids) for c in completions]
            for e, lp in zip(episodes, await self.reference.logprobs.route(pairs), strict=True):
                e.ref_logprobs = lp
        for o in outcomes:
            record_metric("rollout/reward", o.reward)
            record_metric("rollout/reward_std", o.reward, Reduce.STD)
            for name, value in o.rewards.items():
                record_metric(f"rollout/reward/{name}", value)
        return episodes


async def main(cfg: Config) -> None:
    await GRPO.main(cfg)
