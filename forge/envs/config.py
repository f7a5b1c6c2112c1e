"""The `env` section of a run: which environment each episode gets, within which limits."""

from dataclasses import dataclass, field
from typing import Any

from forge.envs.runner import EpisodeLimits
from forge.imports import import_callable


@dataclass
class EnvConfig:
    """Which environment an episode gets.

    Args:
        factory: "module:attribute" of a callable (a class) taking the episode's data row and
            `options` as keyword arguments, returning an Environment. The default, ToolTask
            without tools, is the single-turn task: the first turn is the answer.
        options: keyword arguments for the factory.
        limits: bounds on each episode (turns, sampled tokens, environment call time).

    Where the environments live is the run's `env_resources`: unset, in the loop's process;
    set, in an EnvironmentActor service of that many replicas.
    """

    factory: str = "forge.envs.tasks:ToolTask"
    options: dict[str, Any] = field(default_factory=dict)
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)

    def resolve(self) -> Any:
        """The factory; a name that does not import raises one line naming it."""
        return import_callable(self.factory, "environment factory")
