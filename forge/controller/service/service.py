"""Service: replicas of one ForgeActor behind a single handle.

    gen = await Generator.options(num_replicas=2).as_service(cfg)
    out = await gen.generate.route(prompt)        # one replica (round-robin by default)
    await gen.update_weights.fanout(version)      # every healthy replica
    async with gen.session():                     # sticky: the same replica throughout
        ...
    await gen.scale(4)

The service lives in the caller's process, so routing adds no network hop. Failures follow
this rule: endpoint errors reach the caller and the replica keeps serving; a replica whose
process dies is respawned in the background, set up, passed through `on_recover` and only then
given traffic; a call it was running is retried once elsewhere if the endpoint is `retry_safe`.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# Monarch 0.7 raises this when a call's actor or process died; it is exported only here.
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

from forge.controller.actor import is_retry_safe
from forge.controller.provisioner import get_provisioner
from forge.controller.service.replica import Replica, ReplicaState
from forge.controller.service.router import ROUTERS

if TYPE_CHECKING:
    from forge.controller.actor import ActorOptions

logger = logging.getLogger(__name__)


class ReplicaDiedError(RuntimeError):
    """A call's replica died and the call was not (or could not be) retried."""


class NoHealthyReplicaError(RuntimeError):
    """No replica became healthy within the service's recovery deadline."""


@dataclass
class ServiceConfig:
    """How a service replicates and routes.

    Args:
        num_replicas: replicas to start.
        max_concurrent: requests running at once on one replica; more wait in its queue.
        routing: "round_robin" or "least_loaded".
        health_interval_s: seconds between health checks of every replica.
        recovery_timeout_s: how long a call waits for some replica to be healthy.
        max_restarts: attempts to respawn a dead replica before giving it up.
    """

    num_replicas: int = 1
    max_concurrent: int = 64
    routing: str = "round_robin"
    health_interval_s: float = 2.0
    recovery_timeout_s: float = 300.0
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if self.routing not in ROUTERS:
            raise ValueError(f"routing must be one of {sorted(ROUTERS)}, got {self.routing!r}")
        if self.num_replicas < 0 or self.max_concurrent < 1:
            raise ValueError("num_replicas must be >= 0 and max_concurrent >= 1")


class ServiceEndpoint:
    """One endpoint of a service: `route` to a single replica, `fanout` to all healthy ones."""

    def __init__(self, service: "Service", name: str) -> None:
        self._service = service
        self.name = name
        self.retry_safe = is_retry_safe(service.actor_cls, name)

    async def route(self, *args: Any, **kwargs: Any) -> Any:
        """Calls one replica (the session's, inside `service.session()`) and returns its value."""
        return await self._service._route(self, args, kwargs)

    async def fanout(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Calls every healthy replica and returns their values, in replica order.

        A replica that dies during the call is left out: its respawn passes `on_recover`,
        which is where it catches up.
        """
        return await self._service._fanout(self.name, args, kwargs)


class Service:
    """Replicas of an actor, routed, health-checked, respawned and scaled."""

    def __init__(self, options: "ActorOptions", args: tuple, kwargs: dict) -> None:
        self.options = options
        self.actor_cls = options.actor_cls
        self.cfg = options.service
        self.on_recover: Callable[[Any], Awaitable[None]] | None = None
        self.retries = 0
        self._args, self._kwargs = args, kwargs
        self._replicas: list[Replica] = []
        self._next_index = 0
        self._router = ROUTERS[self.cfg.routing]()
        self._session: ContextVar[list[Replica] | None] = ContextVar(f"session-{id(self)}")
        self._healthy_changed = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._scale_lock = asyncio.Lock()
        self._endpoints: dict[str, ServiceEndpoint] = {}
        self._closed = False

    def __getattr__(self, name: str) -> ServiceEndpoint:
        if name.startswith("_") or not hasattr(self.actor_cls, name):
            raise AttributeError(f"{self.actor_cls.__name__} service has no endpoint {name!r}")
        if name not in self._endpoints:
            self._endpoints[name] = ServiceEndpoint(self, name)
        return self._endpoints[name]

    @property
    def name(self) -> str:
        return self.actor_cls.__name__

    # --- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the replicas and the health checks; returns once all replicas are healthy."""
        get_provisioner().own(self)
        await self.scale(self.cfg.num_replicas)
        self._spawn_task(self._health_loop())

    async def shutdown(self) -> None:
        """Stops health checks, recoveries and every replica's processes."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._stop(r) for r in list(self._replicas)))
        get_provisioner().disown(self)

    async def scale(self, n: int) -> None:
        """Grows or shrinks to `n` replicas while requests are in flight.

        New replicas take traffic once set up; removed ones stop taking new requests, finish
        the ones they hold, then stop.
        """
        async with self._scale_lock:
            live = [r for r in self._replicas if r.state is not ReplicaState.DRAINING]
            if n > len(live):
                await asyncio.gather(*(self._add_replica() for _ in range(n - len(live))))
            for replica in live[n:]:
                replica.state = ReplicaState.DRAINING
            await asyncio.gather(*(self._drain(r) for r in live[n:]))

    async def _add_replica(self) -> None:
        replica = Replica(self._next_index, self.cfg.max_concurrent)
        self._next_index += 1
        self._replicas.append(replica)
        try:
            await self._bring_up(replica)
        except BaseException:
            self._replicas.remove(replica)
            raise

    async def _bring_up(self, replica: Replica) -> None:
        actor, mesh = await self.options.launch(*self._args, **self._kwargs)
        try:
            if replica.state is ReplicaState.STOPPED:
                raise asyncio.CancelledError  # scaled away while starting
            if self.on_recover is not None and replica.generation > 0:
                await self.on_recover(actor)
        except BaseException:
            await get_provisioner().stop_procs(mesh)
            raise
        replica.actor, replica.mesh = actor, mesh
        replica.world_size = self.options.process.procs * (self.options.process.hosts or 1)
        replica.generation += 1
        await self._set_state(replica, ReplicaState.HEALTHY)

    async def _drain(self, replica: Replica) -> None:
        await replica.idle.wait()
        await self._stop(replica)

    async def _stop(self, replica: Replica) -> None:
        replica.state = ReplicaState.STOPPED
        if replica.recovery is not None and replica.recovery is not asyncio.current_task():
            replica.recovery.cancel()
        if replica in self._replicas:
            self._replicas.remove(replica)
        if replica.mesh is not None:
            await get_provisioner().stop_procs(replica.mesh)

    async def _set_state(self, replica: Replica, state: ReplicaState) -> None:
        replica.state = state
        async with self._healthy_changed:
            self._healthy_changed.notify_all()

    def _spawn_task(self, coro: Awaitable[None]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- failures ---------------------------------------------------------------------------

    def _mark_dead(self, replica: Replica, generation: int, error: BaseException) -> None:
        if replica.generation != generation or replica.state is not ReplicaState.HEALTHY:
            return  # already known, or the failure belongs to a process since replaced
        replica.state = ReplicaState.FAILED
        replica.metrics.deaths += 1
        logger.warning(
            "%s replica %d died: %s", self.name, replica.index, str(error).splitlines()[0]
        )
        replica.recovery = self._spawn_task(self._recover(replica))

    async def _recover(self, replica: Replica) -> None:
        await get_provisioner().stop_procs(replica.mesh)
        replica.mesh = None
        if replica.state is not ReplicaState.FAILED:
            return  # scaled away meanwhile
        replica.state = ReplicaState.RECOVERING
        for attempt in range(1, self.cfg.max_restarts + 1):
            try:
                await self._bring_up(replica)
            except Exception as e:
                logger.error(
                    "%s replica %d: respawn attempt %d/%d failed: %s",
                    self.name,
                    replica.index,
                    attempt,
                    self.cfg.max_restarts,
                    e,
                )
                continue
            replica.metrics.recoveries += 1
            logger.warning("%s replica %d recovered", self.name, replica.index)
            return
        await self._set_state(replica, ReplicaState.FAILED)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await asyncio.gather(*(self._check(r) for r in self._replicas if r.healthy))

    async def _check(self, replica: Replica) -> None:
        generation = replica.generation
        try:
            await replica.actor.ping.call()
        except SupervisionError as e:
            self._mark_dead(replica, generation, e)

    # --- calls ------------------------------------------------------------------------------

    async def _healthy_replica(self) -> Replica:
        """The replica for the next call: the session's if it is healthy, else the router's."""
        session = self._session.get(None)
        if session and session[0].healthy:
            return session[0]
        healthy = [r for r in self._replicas if r.healthy]
        if not healthy:
            healthy = await self._wait_for_healthy()
        replica = self._router.pick(healthy)
        if session is not None:
            session[:] = [replica]
        return replica

    async def _wait_for_healthy(self) -> list[Replica]:
        def healthy() -> list[Replica]:
            return [r for r in self._replicas if r.healthy]

        try:
            async with asyncio.timeout(self.cfg.recovery_timeout_s), self._healthy_changed:
                return await self._healthy_changed.wait_for(healthy)
        except TimeoutError:
            raise NoHealthyReplicaError(
                f"{self.name} service: no healthy replica within {self.cfg.recovery_timeout_s}s"
            ) from None

    async def _route(self, endpoint: ServiceEndpoint, args: tuple, kwargs: dict) -> Any:
        replica = await self._healthy_replica()
        generation = replica.generation
        try:
            return await replica.call(endpoint.name, args, kwargs)
        except SupervisionError as e:
            self._mark_dead(replica, generation, e)
            if not endpoint.retry_safe:
                raise ReplicaDiedError(
                    f"{self.name}.{endpoint.name}: replica {replica.index} died during the call "
                    "(endpoint not retry_safe, so not retried)"
                ) from e
        self.retries += 1
        replica = await self._healthy_replica()
        generation = replica.generation
        try:
            return await replica.call(endpoint.name, args, kwargs)
        except SupervisionError as e:
            self._mark_dead(replica, generation, e)
            raise ReplicaDiedError(
                f"{self.name}.{endpoint.name}: replica died, and so did the one it was retried on"
            ) from e

    async def _fanout(self, name: str, args: tuple, kwargs: dict) -> list[Any]:
        replicas = [r for r in self._replicas if r.healthy]
        generations = [r.generation for r in replicas]
        results = await asyncio.gather(
            *(r.call(name, args, kwargs) for r in replicas), return_exceptions=True
        )
        values = []
        for replica, generation, result in zip(replicas, generations, results, strict=True):
            if isinstance(result, SupervisionError):
                self._mark_dead(replica, generation, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                values.append(result)
        return values

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        """Routes every call made inside the block to one replica (a new one if it dies)."""
        token = self._session.set([])
        try:
            yield
        finally:
            self._session.reset(token)

    # --- introspection ----------------------------------------------------------------------

    @property
    def num_healthy(self) -> int:
        return sum(r.healthy for r in self._replicas)

    def metrics(self) -> list[dict[str, Any]]:
        """Per-replica state, request and failure counts, queue depth and latency."""
        return [r.snapshot() for r in self._replicas]

    def replica_actors(self) -> list[Any]:
        """The actor handles of the healthy replicas, in replica order."""
        return [r.actor for r in self._replicas if r.healthy]
