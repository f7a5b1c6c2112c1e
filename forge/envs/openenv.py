"""Environments written for OpenEnv (`openenv-core` 0.3.0, the PyTorch ecosystem's environment
spec, also TRL's) run as forge environments, unchanged.

An OpenEnv environment is a Python object with `reset()` and `step(action)`, where the action
is a typed pydantic model and the observation another, carrying `done` and a reward at every
step. `OpenEnvTask` drives one in process (no HTTP server, no Docker): its observations become
`user` messages (the observation's fields, as JSON, or the one field alone), and the model's
turn becomes the action: a JSON object of the action's fields, or, for an action with one
required field, the turn's text itself. A turn that makes no valid action is answered with an
error message naming what is wrong, and the episode goes on. Rewards add up over the episode.

Why OpenEnv rather than verifiers (PRIME-RL's): forge must drive the turns and own the tokens,
and OpenEnv's step interface lets it, in process; verifiers 0.4 runs its own turn loop in a
separate program that calls a model server, and pins versions of mcp and openai that the rest
of forge's stack does not share.

    data: ...
    env: {factory: "forge.envs.openenv:OpenEnvTask",
          options: {environment: "echo_env.server.echo_env_environment:EchoEnvironment"}}
"""

import asyncio
import json
import typing
from typing import Any

from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
from pydantic import BaseModel, ValidationError

from forge.envs.environment import Message, StepResult
from forge.imports import import_callable

_SHOWN_APART = {"done", "reward", "metadata"}


class OpenEnvTask:
    """One episode of an OpenEnv environment.

    Args:
        row: the data row (its `prompt`, if any, comes before the first observation).
        environment: "module:attribute" of the OpenEnv Environment class.
        options: keyword arguments for it.
    """

    def __init__(
        self, row: dict[str, Any], environment: str, options: dict[str, Any] | None = None
    ) -> None:
        cls = import_callable(environment, "OpenEnv environment")
        self.env = cls(**(options or {}))
        if not isinstance(self.env, OpenEnvEnvironment):
            raise TypeError(f"{environment} is not an OpenEnv Environment")
        action_type = typing.get_type_hints(type(self.env).step).get("action")
        if not (isinstance(action_type, type) and issubclass(action_type, BaseModel)):
            raise TypeError(f"{environment}.step's action is not annotated with its Action class")
        self.action_type: type[BaseModel] = action_type
        self.prompt = list(row.get("prompt") or [])

    async def reset(self) -> list[Message]:
        if _overrides(self.env, "reset_async"):
            observation = await self.env.reset_async()
        else:
            observation = await asyncio.to_thread(self.env.reset)
        properties = self.action_type.model_json_schema().get("properties", {})
        fields = {
            name: ": ".join(filter(None, (p.get("type"), p.get("description"))))
            for name, p in properties.items()
            if name not in _SHOWN_APART
        }
        how = f"Answer with a JSON object of the action's fields: {json.dumps(fields)}."
        intro = [*self.prompt, {"role": "user", "content": f"{_shown(observation)}\n{how}"}]
        return intro

    async def step(self, text: str) -> StepResult:
        try:
            action = parse_action(text, self.action_type)
        except ValueError as e:
            error = {"role": "user", "content": f"error: {e}"}
            return StepResult([error], metrics={"malformed_actions": 1})
        if _overrides(self.env, "step_async"):
            observation = await self.env.step_async(action)
        else:
            observation = await asyncio.to_thread(self.env.step, action)
        reward = float(observation.reward or 0.0)
        if observation.done:
            return StepResult(done=True, reward=reward)
        return StepResult([{"role": "user", "content": _shown(observation)}], reward=reward)

    async def close(self) -> None:
        await asyncio.to_thread(self.env.close)


def parse_action(text: str, action_type: type[BaseModel]) -> BaseModel:
    """The action a turn's text makes: its JSON object, or the text as the one required field.

    Raises:
        ValueError: neither makes a valid action; the message names why.
    """
    body = text.strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        required = action_type.model_json_schema().get("required", [])
        if len(required) != 1:
            raise ValueError(f"the action is a JSON object with the fields {required}")
        value = {required[0]: body}
    try:
        return action_type.model_validate(value)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors())
        raise ValueError(f"not a valid {action_type.__name__}: {problems}") from None


def _shown(observation: BaseModel) -> str:
    fields = observation.model_dump(mode="json", exclude=_SHOWN_APART)
    return str(next(iter(fields.values()))) if len(fields) == 1 else json.dumps(fields)


def _overrides(env: OpenEnvEnvironment, method: str) -> bool:
    """Whether the environment has an async method of its own (the base one calls the sync
    method with arguments a plain `reset()` may not take)."""
    return getattr(type(env), method) is not getattr(OpenEnvEnvironment, method)
