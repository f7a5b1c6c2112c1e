"""The environment protocol: what an episode of a multi-turn, tool-using task is made of.

An environment is made for one episode from a data row. It gives the first prompt (chat
messages), takes each of the model's turns (its text) and answers with the messages that follow
it (tool results, a user's feedback) and a reward, or ends the episode. It is plain async
Python: forge renders the messages to tokens (forge.data.chat), samples the turns, keeps the
trajectory token-exact (forge.data.trajectory) and enforces the episode's limits
(forge.envs.runner).

    class GuessEnv:
        def __init__(self, row):
            self.secret = int(row["answer"])

        async def reset(self):
            return [{"role": "user", "content": "Guess my number (1-100)."}]

        async def step(self, text):
            guess = int(text.strip()) if text.strip().isdigit() else None
            if guess == self.secret:
                return StepResult(done=True, reward=1.0)
            hint = "higher" if guess is not None and guess < self.secret else "lower"
            return StepResult([{"role": "user", "content": hint}])

        async def close(self):
            pass
"""

from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, Any]


@dataclass
class StepResult:
    """An environment's answer to one turn.

    Args:
        messages: what follows the turn (tool results, feedback); empty when the episode ends.
        done: the episode is over.
        reward: this step's reward; the episode's is the sum over its steps (a task that
            scores only its answer gives it with `done`).
        rewards: this step's score from each reward function, by name; summed per name.
        metrics: counts of this step, summed over the episode and logged under `env/` (e.g.
            "tool_calls", "well_formed_calls").
    """

    messages: list[Message] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class EnvironmentLost(RuntimeError):
    """The episode's environment state is gone (its process died or was replaced): the episode
    starts again from its first turn, and what was sampled for it is dropped."""


class Environment(Protocol):
    """One episode of a task; made by the task's factory from a data row: `factory(row)`."""

    async def reset(self) -> list[Message]:
        """The first prompt's messages."""
        ...

    async def step(self, text: str) -> StepResult:
        """The answer to the model's turn `text`."""
        ...

    async def close(self) -> None:
        """Gives back what the episode holds (processes, files); called however it ended."""
        ...
