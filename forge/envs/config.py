"""The `env` section of a run: which environment each episode gets, within which limits."""

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any

from forge.config import FieldError, field_error
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

    def check_available(self) -> None:
        """Raises FieldError unless the factory imports here and its signature takes
        `options`: a misspelt option fails before anything starts, not in every episode."""
        with field_error("factory"):
            factory = self.resolve()
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):  # no signature to read: the first episode will tell
            return
        _check_options(self.factory, signature, self.options)


def _check_options(name: str, signature: inspect.Signature, options: dict[str, Any]) -> None:
    """Raises FieldError for an option the factory `name` does not take (unless it takes
    **kwargs), or a required one that is missing. Its first parameter takes the row."""
    params = list(signature.parameters.values())[1:]
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        for key in options:
            if key not in takes:
                raise FieldError(
                    f"options.{key}", f"{name} takes no option {key!r}" + _hint(key, takes)
                )
    try:
        signature.bind(None, **options)
    except TypeError as e:
        raise FieldError("options", f"{name}: {e}") from None


def _hint(key: str, takes: list[str]) -> str:
    """The closest option the factory takes, or all of them."""
    if close := difflib.get_close_matches(str(key), takes, n=1):
        return f" (did you mean {close[0]!r}?)"
    return f" (it takes: {', '.join(takes)})" if takes else " (it takes none)"
