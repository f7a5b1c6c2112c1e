"""EnvironmentActor: environments served by replicas, one environment per episode.

    envs = await EnvironmentActor.options(num_replicas=2).as_service(
        EnvConfig(factory="my_tasks:GuessNumber", options={"high": 100})
    )
    async with envs.session():   # an episode's calls go to one replica
        outcome = await play(lambda: RemoteEnvironment(envs, "e7", row), bridge, sample, limits)

Environment state lives in the replica that opened it, so an episode's calls are sticky
(`service.session()`). A replica that dies or hangs takes its episodes' state with it: their
next call raises `EnvironmentLost` (the service has routed the session to another replica,
which has no such episode) and `play` starts each again from its first turn there. Tool calls
run in the replicas, never in the caller's loop.
"""

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from monarch.actor import ActorError, endpoint
from monarch.actor.concurrent import concurrent_endpoint

from forge.controller import ForgeActor
from forge.controller.service.service import ReplicaDiedError, Service
from forge.envs.config import EnvConfig
from forge.envs.environment import Environment, EnvironmentLost, Message, StepResult

T = TypeVar("T")


class EnvironmentActor(ForgeActor):
    """Opens, steps and closes environments by episode id (`cfg.factory` and `cfg.options`
    make them; the rest of the env section is the caller's)."""

    def __init__(self, cfg: EnvConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.open_envs: dict[str, Environment] = {}
        self.stepping: dict[str, asyncio.Future] = {}

    @endpoint
    async def setup(self) -> None:
        """Imports the factory: a bad name fails the start, in one line."""
        self.factory = self.cfg.resolve()

    @concurrent_endpoint
    async def open(self, episode: str, row: dict[str, Any]) -> list[Message]:
        """Makes the episode's environment from its row; its first prompt."""
        if episode in self.open_envs:
            raise ValueError(f"episode {episode} is open already")
        env = self.factory(row, **self.cfg.options)
        self.open_envs[episode] = env
        return await env.reset()

    @concurrent_endpoint
    async def step(self, episode: str, text: str) -> StepResult:
        """The episode's environment's answer to the model's turn."""
        env = self.open_envs.get(episode)
        if env is None:
            raise EnvironmentLost(f"episode {episode} is not open on this replica")
        # A task, so that closing the episode (after the caller's step timeout) cancels it.
        self.stepping[episode] = step = asyncio.ensure_future(env.step(text))
        try:
            return await step
        finally:
            self.stepping.pop(episode, None)

    @concurrent_endpoint
    async def close(self, episode: str) -> None:
        """Closes the episode's environment, if this replica has it."""
        await self._close(episode)

    @endpoint
    async def episodes_open(self) -> int:
        return len(self.open_envs)

    async def _close(self, episode: str) -> None:
        step = self.stepping.pop(episode, None)
        if step is not None:
            step.cancel()
        env = self.open_envs.pop(episode, None)
        if env is not None:
            await env.close()

    async def __cleanup__(self, exc: Exception | None) -> None:
        for episode in list(self.open_envs):
            await self._close(episode)


class RemoteEnvironment:
    """One episode's environment on an EnvironmentActor service (the Environment protocol).

    Call it inside the service's `session()`: its calls must reach the replica that opened it.
    """

    def __init__(self, service: Service, episode: str, row: dict[str, Any]) -> None:
        self.service, self.episode, self.row = service, episode, row

    async def reset(self) -> list[Message]:
        return await _lost_or_raised(self.service.open.route(self.episode, self.row))

    async def step(self, text: str) -> StepResult:
        return await _lost_or_raised(self.service.step.route(self.episode, text))

    async def close(self) -> None:
        try:
            await self.service.close.route(self.episode)
        except ReplicaDiedError:
            pass  # its state went with its replica


async def _lost_or_raised(call: Awaitable[T]) -> T:
    """A replica's death as the episode's lost state; the environment's error as it raised it."""
    try:
        return await call
    except ReplicaDiedError as e:
        raise EnvironmentLost(str(e)) from e
    except ActorError as e:
        raise e.exception from None
