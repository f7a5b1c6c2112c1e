"""The generators as the loop calls them: one method per Generator endpoint the loop uses, on
the generator service (routed to one replica, or fanned out to every one).

Generate calls take the generating turn and weight updates the training turn
(forge.placement.turns), so colocated generation and training never run at once, whoever
calls.
"""

from contextlib import AbstractAsyncContextManager
from typing import Any

from forge.data.completion import Completion
from forge.placement.turns import Turns


class GeneratorHandle:
    """Calls on the running `Generator` service (`forge.actors.generator`); see its endpoints.

    Args:
        service: the generator service, kept as `service` (replica recovery, metrics pulls).
        turns: the colocated turns (the run's placer's); None: generators alone on their
            devices.
    """

    def __init__(self, service: Any, turns: Turns | None = None) -> None:
        self.service = service
        self.turns = turns or Turns(enabled=False)

    def turn(self) -> AbstractAsyncContextManager[None]:
        """The generating turn held over several calls and what depends on them (a rollout and
        its scoring): the calls inside find it held. Each generate call takes it anyway, so
        forgetting it is safe."""
        return self.turns.generating()

    def session(self) -> AbstractAsyncContextManager[None]:
        """Routes every generate call inside the block to one replica (a new one if it dies)."""
        return self.service.session()

    async def generate(
        self,
        prompt: str | list[dict[str, str]] | list[int],
        n: int | None = None,
        sampling: dict[str, Any] | None = None,
        purpose: str = "rollout",
    ) -> list[Completion]:
        """`n` completions of `prompt` from one replica (`Generator.generate`)."""
        async with self.turns.generating():
            return await self.service.generate.route(
                prompt, n=n, sampling=sampling, purpose=purpose
            )

    async def update_weights(self, version: int) -> list[dict[str, Any]]:
        """Every replica moved to weight `version`; each one's account of the update."""
        async with self.turns.training():
            return await self.service.update_weights.fanout(version)

    async def use_cores(self, cpus: list[int]) -> None:
        """Every replica (and its engine) moved onto `cpus`."""
        await self.service.use_cores.fanout(cpus)

    async def cores(self) -> list[dict[str, Any]]:
        """Each replica's pid, cores and threads, and its engine's (`engine`)."""
        return await self.service.cores.fanout()

    async def cpus(self) -> list[int]:
        """The first replica's cores."""
        return (await self.cores())[0]["cpus"]

    async def stats(self) -> list[dict[str, float]]:
        """Each replica's engine statistics since the last call."""
        return await self.service.stats.fanout()

    async def busy_spans(self) -> list[list[tuple[str, float, float]]]:
        """Each replica's busy intervals since the last call."""
        return await self.service.busy_spans.fanout()

    def metrics(self) -> list[dict[str, Any]]:
        """Each replica's deaths, recoveries and hangs (the service's own counts)."""
        return self.service.metrics()
