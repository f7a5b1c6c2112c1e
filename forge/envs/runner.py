"""One episode of an environment, turn by turn, into a token-exact trajectory, within limits.

The turns are sampled from the trajectory's own ids (never from re-rendered text); each answer
of the environment is appended as the ids the chat template renders it to. An episode ends
when the environment says so, at `max_turns`, when its sampled tokens reach `max_tokens`, when
its tokens fill the model's context (`max_context`: no room left for a turn), or
when the environment fails: a step that raises or outlives `step_timeout_s` ends it with
status "error" or "timeout" and reward 0, and the caller decides what becomes of its group.
Otherwise its reward is the sum of its steps' rewards.
An environment whose state was lost (`EnvironmentLost`) is not a failure of the task: the
episode is played again from its first turn (`play`).
"""

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from forge.data.chat import ChatBridge, NotAppendOnly
from forge.data.completion import Completion
from forge.data.trajectory import Trajectory
from forge.envs.environment import Environment, EnvironmentLost, Message

logger = logging.getLogger(__name__)

T = TypeVar("T")
Status = Literal["done", "max_turns", "max_tokens", "max_context", "error", "timeout"]
# Samples one turn: (prompt ids, sampled tokens left in the episode or None) -> the completion
# of those ids, at most that many tokens long and no longer than the sampler's own turn budget.
Sampler = Callable[[list[int], int | None], Awaitable[Completion]]


@dataclass
class EpisodeLimits:
    """Bounds on one episode.

    Args:
        max_turns: sampled turns at most.
        max_tokens: sampled tokens at most, over all turns; None: only each turn's own budget
            (the generator's `sampling.max_tokens`) bounds them.
        step_timeout_s: how long one environment call (reset, step, close) may take.
    """

    max_turns: int = 4
    max_tokens: int | None = None
    step_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_turns < 1 or (self.max_tokens is not None and self.max_tokens < 1):
            raise ValueError(f"max_turns and max_tokens must be >= 1, got {self}")
        if self.step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be positive, got {self.step_timeout_s}")


@dataclass
class EpisodeOutcome:
    """How an episode ended: its trajectory, reward and `env/` counts."""

    trajectory: Trajectory
    status: Status
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: Counter[str] = field(default_factory=Counter)
    error: str = ""


class _EnvFailed(Exception):
    def __init__(self, status: Status, error: str) -> None:
        super().__init__(error)
        self.status, self.error = status, error


async def run_episode(
    env: Environment,
    bridge: ChatBridge,
    sample: Sampler,
    limits: EpisodeLimits,
    max_context: int | None = None,
) -> EpisodeOutcome:
    """Plays `env` to its end with turns from `sample`, and closes it however the episode ends.
    The environment's failures end the episode (its outcome says how); the sampler's, and a
    lost environment (`EnvironmentLost`), raise. `max_context`: the model's context length
    (prompt and sampled tokens together); a turn after the first is given at most the room
    left in it."""
    outcome = EpisodeOutcome(Trajectory([]), "max_turns")
    try:
        messages = list(await _env(env.reset(), limits))
        outcome.trajectory = Trajectory(bridge.first(messages))
        await _play(env, bridge, sample, limits, max_context, messages, outcome)
    except _EnvFailed as failure:
        logger.warning("episode ended by its environment (%s): %s", failure.status, failure)
        outcome.status, outcome.error = failure.status, failure.error
        outcome.reward, outcome.rewards = 0.0, {}
        outcome.metrics["errors" if failure.status == "error" else "timeouts"] += 1
    finally:
        await _close(env, limits)
    outcome.metrics["turns"] = outcome.trajectory.turns
    return outcome


async def _play(
    env: Environment,
    bridge: ChatBridge,
    sample: Sampler,
    limits: EpisodeLimits,
    max_context: int | None,
    messages: list[Message],
    outcome: EpisodeOutcome,
) -> None:
    trajectory = outcome.trajectory
    while trajectory.turns < limits.max_turns:
        bounds: dict[Status, int] = {}
        if limits.max_tokens is not None:
            bounds["max_tokens"] = limits.max_tokens - trajectory.sampled_tokens
        if max_context is not None and trajectory.turns:  # a first prompt too long is an error
            bounds["max_context"] = max_context - len(trajectory.context)
        spent = [status for status, left in bounds.items() if left <= 0]
        if spent:
            outcome.status = spent[0]
            return
        turn = await sample(trajectory.context, min(bounds.values(), default=None))
        trajectory.add_turn(turn)
        step = await _env(env.step(turn.text), limits)
        outcome.metrics.update(step.metrics)
        outcome.reward += step.reward
        for name, score in step.rewards.items():
            outcome.rewards[name] = outcome.rewards.get(name, 0.0) + score
        if step.done:
            outcome.status = "done"
            return
        if trajectory.turns < limits.max_turns:
            trajectory.add_observation(_rendered(bridge, messages, turn, step.messages))
        messages += [{"role": "assistant", "content": turn.text}, *step.messages]


def _rendered(
    bridge: ChatBridge, history: list[Message], turn: Completion, new: list[Message]
) -> list[int]:
    """The ids of the environment's answer; messages the template cannot render (none, a
    role it refuses) are the environment's error. A template that rewrites history raises."""
    try:
        return bridge.extend(history, turn.text, turn.token_ids, new)
    except NotAppendOnly:
        raise
    except Exception as e:
        raise _EnvFailed("error", f"its answer does not render: {e}") from e


async def _close(env: Environment, limits: EpisodeLimits) -> None:
    """Closes the environment; a close that fails or hangs is logged, the outcome stands."""
    try:
        async with asyncio.timeout(limits.step_timeout_s):
            await env.close()
    except Exception as e:
        logger.warning("environment close failed: %s: %s", type(e).__name__, e)


async def _env(call: Awaitable[T], limits: EpisodeLimits) -> T:
    """An environment call, its raise or overrun turned into the episode's end."""
    deadline = asyncio.timeout(limits.step_timeout_s)
    try:
        async with deadline:
            return await call
    except TimeoutError as e:
        if not deadline.expired():  # the environment's own timeout, raised inside it
            raise _EnvFailed("error", f"TimeoutError: {e}") from e
        raise _EnvFailed("timeout", f"no answer within {limits.step_timeout_s} s") from None
    except EnvironmentLost:
        raise
    except Exception as e:  # the environment's failure ends its episode, not the run
        raise _EnvFailed("error", f"{type(e).__name__}: {e}") from e


async def play(
    make: Callable[[], Environment],
    bridge: ChatBridge,
    sample: Sampler,
    limits: EpisodeLimits,
    max_context: int | None = None,
    attempts: int = 3,
) -> EpisodeOutcome:
    """`run_episode` on a new environment from `make`, again from the first turn each time the
    environment is lost, up to `attempts` times; `metrics["restarts"]` counts the restarts."""
    for restarts in range(attempts):
        try:
            outcome = await run_episode(make(), bridge, sample, limits, max_context)
        except EnvironmentLost as lost:
            logger.warning("episode restarts from its first turn: %s", lost)
            continue
        outcome.metrics["restarts"] = restarts
        return outcome
    raise EnvironmentLost(f"the episode's environment was lost {attempts} times")
