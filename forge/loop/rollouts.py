"""Rollouts: every rollout and every eval answer, played in the run's environment.

A data row becomes `n` episodes of the `env` section's environment (forge.envs), each turn
sampled by the generators from the episode's own token ids. The single-turn task (the default:
ToolTask without tools) is the episode of one turn, so GRPO, distillation and eval have one
rollout path whatever the task. The reward functions (the `reward` section) then score each
episode's answer, its last turn, and add to what the environment rewarded.

Sampling seeds: episode i of a row seeded s samples its first turn with seed s + i (what one
request for n samples seeded s gives vLLM's i-th sample), and turn t with s + i + t * TURN_SEED.
"""

import contextlib
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

from forge.actors.environment import RemoteEnvironment
from forge.concurrency import all_or_none
from forge.data.chat import ChatBridge
from forge.data.completion import Completion
from forge.data.trajectory import Trajectory
from forge.envs.config import EnvConfig
from forge.envs.environment import Environment, EnvironmentLost
from forge.envs.runner import EpisodeOutcome, play
from forge.loop.generator_handle import GeneratorHandle
from forge.observability import Reduce, record_metric
from forge.observability.busy import BusyClock

TURN_SEED = 1_000_033
# Rollouts that ended this way were cut short by their environment: no answer to score.
FAILED = ("error", "timeout")
_SUMMED = ("errors", "timeouts", "restarts")  # counted over the episodes, not averaged


class Rollouts:
    """Plays a row's episodes and scores their answers.

    Args:
        cfg: the env section.
        generator: the generators.
        bridge: renders the environment's messages to token ids (the generators' tokenizer).
        turn_tokens: a turn's token budget where the sampling gives none (the generator's
            `sampling.max_tokens`).
        max_context: the generators' context length (`max_model_len`): an episode whose
            tokens fill it ends there (status "max_context").
        environments: the EnvironmentActor service (the run's `env_resources`), or None:
            environments are made in this process.
        reward: the reward service, or None where nothing is scored.
    """

    def __init__(
        self,
        cfg: EnvConfig,
        generator: GeneratorHandle,
        bridge: ChatBridge,
        turn_tokens: int,
        max_context: int,
        environments: Any | None = None,
        reward: Any | None = None,
    ) -> None:
        self.cfg = cfg
        self.generator = generator
        self.bridge = bridge
        self.turn_tokens = turn_tokens
        self.max_context = max_context
        self.environments = environments
        self.reward = reward
        self.factory = cfg.resolve() if environments is None else None
        self.busy = BusyClock()  # time with at least one rollout turn being sampled

    async def play(
        self,
        row: dict[str, Any],
        n: int,
        sampling: dict[str, Any] | None = None,
        seed: int | None = None,
        purpose: str = "rollout",
    ) -> list[EpisodeOutcome]:
        """`n` episodes of `row`, their turns sampled with `sampling` (overrides of the
        generator's) and seeded from `seed` (none: unseeded). An episode whose environment was
        lost more often than `play` retries ends with status "error". A failure of the
        generators raises, and cancels the other episodes."""
        seeds = [None if seed is None else seed + i for i in range(n)]
        # One replica samples the whole group, as one request for n samples did.
        async with self.generator.session():
            return await all_or_none(
                self._one(row, _Turns(self, sampling or {}, s, purpose)) for s in seeds
            )

    async def _one(self, row: dict[str, Any], turns: "_Turns") -> EpisodeOutcome:
        limits, context = self.cfg.limits, self.max_context

        def make() -> Environment:  # each attempt samples with the episode's own seeds again
            turns.count = 0
            if self.environments is None:
                return self.factory(row, **self.cfg.options)
            return RemoteEnvironment(self.environments, uuid.uuid4().hex, row)

        # In replicas, one session: the episode's calls reach one replica.
        local = self.environments is None
        session = contextlib.nullcontext() if local else self.environments.session()
        try:
            async with session:
                return await play(make, self.bridge, turns.sample, limits, context)
        except EnvironmentLost as lost:
            return EpisodeOutcome(
                Trajectory([]), "error", error=str(lost), metrics=Counter(errors=1)
            )

    async def score(self, rows: Sequence[dict[str, Any]], outcomes: list[EpisodeOutcome]) -> int:
        """Adds the reward functions' scores of each episode's answer (its last turn) to its
        reward, per function too; an episode its environment cut short is not scored. Returns
        how many function calls failed (each scored 0). Without a reward service (no reward
        functions) the environment's rewards stand alone."""
        if self.reward is None:
            return 0
        scored = [(r, o) for r, o in zip(rows, outcomes, strict=True) if o.status not in FAILED]
        if not scored:
            return 0
        answers = [o.trajectory.texts[-1] for _, o in scored]
        results = await self.reward.evaluate.route([r for r, _ in scored], answers)
        for (_, outcome), result in zip(scored, results, strict=True):
            outcome.reward += result.reward
            for name, value in result.rewards.items():
                outcome.rewards[name] = outcome.rewards.get(name, 0.0) + value
        return sum(len(result.failed) for result in results)


class _Turns:
    """One episode's sampler: turn t seeded `seed + t * TURN_SEED`, within the turn budget."""

    def __init__(
        self, rollouts: Rollouts, sampling: dict[str, Any], seed: int | None, purpose: str
    ) -> None:
        self.rollouts, self.sampling, self.seed, self.purpose = rollouts, sampling, seed, purpose
        self.budget = sampling.get("max_tokens", rollouts.turn_tokens)
        self.count = 0

    async def sample(self, context: list[int], left: int | None) -> Completion:
        params = {
            **self.sampling,
            "max_tokens": self.budget if left is None else min(self.budget, left),
        }
        if self.seed is not None:
            params["seed"] = self.seed + self.count * TURN_SEED
        self.count += 1
        # generator/idle_fraction: the time rollouts keep the generators busy.
        busy = self.rollouts.busy if self.purpose == "rollout" else contextlib.nullcontext()
        async with busy:
            (turn,) = await self.rollouts.generator.generate(context, 1, params, self.purpose)
        return turn


def outcome_metrics(outcomes: Sequence[EpisodeOutcome]) -> dict[str, tuple[float, Reduce]]:
    """The episodes' `env/` counts, each with how a step reduces it: errors, timeouts and
    restarts summed; turns, tool calls and the environment's own counts per episode; the
    fraction of tool calls that were well formed."""
    totals = dict.fromkeys(_SUMMED, 0.0)
    for outcome in outcomes:
        for key, value in outcome.metrics.items():
            totals[key] = totals.get(key, 0.0) + value
    counts = {
        key: (total, Reduce.SUM) if key in _SUMMED else (total / len(outcomes), Reduce.MEAN)
        for key, total in totals.items()
    }
    if totals.get("tool_calls"):
        fraction = totals["well_formed_calls"] / totals["tool_calls"]
        counts["well_formed_fraction"] = (fraction, Reduce.MEAN)
    return counts


def record_outcomes(outcomes: Sequence[EpisodeOutcome]) -> None:
    """Records the episodes' `outcome_metrics` under `env/`, in the step's metrics."""
    for key, (value, reduce) in outcome_metrics(outcomes).items():
        record_metric(f"env/{key}", value, reduce)
