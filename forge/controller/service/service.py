"""Service: replicas of one ForgeActor behind a single handle.

    gen = await Generator.options(num_replicas=2).as_service(cfg)
    out = await gen.generate.route(prompt)        # one replica (round-robin by default)
    await gen.update_weights.fanout(version)      # every healthy replica
    async with gen.session():                     # sticky: the same replica throughout
        ...
    await gen.scale(4)

The service lives in the caller's process, so routing adds no network hop. Failures follow
this rule: endpoint errors reach the caller and the replica keeps serving; a replica whose
process dies, or that misses `health_misses` health checks in a row (it hung), is taken out of
routing, its processes stopped, and respawned in the background, set up, passed through
`on_recover` and only then given traffic; a call it was running or queueing is retried once
elsewhere if the endpoint is `retry_safe`, else fails with an error naming the replica. A
replica whose host is lost is not respawned; once every replica is lost, calls fail at once
with ReplicasLostError naming the host. A replica added by `scale` to a started service also
passes through `on_recover` before it takes traffic.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from monarch.actor import ActorError, ProcMesh

from forge.controller.endpoints import is_retry_safe
from forge.controller.monarch_compat import SupervisionError
from forge.controller.provisioner import HostLostError, ProcessConfig, first_line, get_provisioner
from forge.controller.service.replica import CallAbandoned, Replica, ReplicaState
from forge.controller.service.router import ROUTERS
from forge.observability.console import say

logger = logging.getLogger(__name__)


class ReplicaDiedError(RuntimeError):
    """A call's replica died and the call was not (or could not be) retried."""


class ReplicaHungError(ReplicaDiedError):
    """A call's replica stopped answering health checks and was replaced; the call was not
    (or could not be) retried."""


class NoHealthyReplicaError(RuntimeError):
    """No replica became healthy within the service's recovery deadline."""


class ReplicasLostError(NoHealthyReplicaError):
    """Every replica of the service was on a host now lost: none will come back."""


@dataclass
class ServiceConfig:
    """How a service replicates and routes.

    Args:
        num_replicas: replicas to start.
        max_concurrent: requests running at once on one replica; more wait in its queue.
        routing: "round_robin" or "least_loaded".
        health_interval_s: seconds between health checks of a replica.
        health_timeout_s: how long a health check (a `ping`) may go unanswered before it counts
            as missed. A plain `@endpoint` holds its actor's message loop while it runs, so
            `ping` waits behind it: keep `health_timeout_s * health_misses` above the longest
            such call, or it is taken for a hang.
        health_misses: missed checks in a row that mark a replica hung; a missed check is
            followed at once by the next, so a hang is detected within
            `health_interval_s + health_misses * health_timeout_s`.
        recovery_timeout_s: how long a call waits for some replica to be healthy.
        max_restarts: attempts to respawn a dead replica before giving it up.
    """

    num_replicas: int = 1
    max_concurrent: int = 64
    routing: str = "round_robin"
    health_interval_s: float = 2.0
    health_timeout_s: float = 30.0
    health_misses: int = 3
    recovery_timeout_s: float = 300.0
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if self.routing not in ROUTERS:
            raise ValueError(f"routing must be one of {sorted(ROUTERS)}, got {self.routing!r}")
        if self.num_replicas < 0 or self.max_concurrent < 1:
            raise ValueError("num_replicas must be >= 0 and max_concurrent >= 1")
        for key in ("health_interval_s", "health_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.health_misses < 1:
            raise ValueError(f"health_misses must be >= 1, got {self.health_misses}")


class ReplicaSpec(Protocol):
    """What a service starts each replica from: `ActorOptions` (forge/controller/actor.py),
    described here so that this module need not import the actor module, which imports it."""

    @property
    def actor_cls(self) -> type: ...

    @property
    def process(self) -> ProcessConfig: ...

    @property
    def service(self) -> ServiceConfig: ...

    async def launch(self, *args: Any, **kwargs: Any) -> tuple[Any, ProcMesh]:
        """Starts one replica's processes and actor, set up; returns the actor and its mesh."""


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

        A replica that dies or hangs during the call is left out: its respawn passes
        `on_recover`, which is where it catches up.
        """
        return await self._service._fanout(self.name, args, kwargs)


class Service:
    """Replicas of an actor, routed, health-checked, respawned and scaled."""

    def __init__(self, options: ReplicaSpec, args: tuple, kwargs: dict) -> None:
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
        self._started = False  # from then on, a new replica catches up (`on_recover`)

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
        """Starts the replicas, each health-checked; returns once all replicas are healthy.

        If one fails to start, the others are stopped too and the first error is raised.
        """
        get_provisioner().own(self)
        try:
            await self.scale(self.cfg.num_replicas)
        except BaseException:
            await self.shutdown()
            raise
        self._started = True

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
            # A lost replica is no capacity: scaling up replaces it, down never keeps it.
            gone = (ReplicaState.DRAINING, ReplicaState.LOST)
            live = [r for r in self._replicas if r.state not in gone]
            if n > len(live):
                # Every start settles before an error is raised: none is left starting unseen.
                started = await asyncio.gather(
                    *(self._add_replica() for _ in range(n - len(live))), return_exceptions=True
                )
                errors = [e for e in started if isinstance(e, BaseException)]
                if errors:
                    raise errors[0]
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
            if replica in self._replicas:  # a concurrent shutdown may have removed it
                self._replicas.remove(replica)
            raise

    async def _bring_up(self, replica: Replica) -> None:
        actor, mesh = await self.options.launch(*self._args, **self._kwargs)
        try:
            if replica.state is ReplicaState.STOPPED:
                raise asyncio.CancelledError  # scaled away while starting
            # A respawn, or a replica added to a running service: it catches up first.
            if self.on_recover is not None and (replica.generation > 0 or self._started):
                await self.on_recover(actor)
        except BaseException:
            await get_provisioner().stop_procs(mesh)
            raise
        replica.actor, replica.mesh = actor, mesh
        replica.world_size = self.options.process.procs * (self.options.process.hosts or 1)
        replica.generation += 1
        replica.missed_checks = 0
        await self._set_state(replica, ReplicaState.HEALTHY)
        self._spawn_task(self._watch(replica))

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

    def _is_current(self, replica: Replica, generation: int) -> bool:
        """Whether `generation` of `replica` is the one serving (not failed or replaced)."""
        return replica.generation == generation and replica.state is ReplicaState.HEALTHY

    def _mark_dead(self, replica: Replica, generation: int, error: BaseException) -> None:
        if not self._is_current(replica, generation):
            return  # already known, or the failure belongs to a process since replaced
        replica.metrics.deaths += 1
        logger.warning("%s replica %d died: %s", self.name, replica.index, first_line(error))
        self._replace(replica)
        # Calls already sent to the dead process may never be answered.
        replica.abandon_calls(died=True)

    def _mark_hung(self, replica: Replica, generation: int) -> None:
        if not self._is_current(replica, generation):
            return
        replica.metrics.hangs += 1
        logger.warning(
            "%s replica %d hung: %s; replacing it", self.name, replica.index, self._hang_cause()
        )
        self._replace(replica)
        replica.abandon_calls(died=False)  # they would wait forever; retry-safe ones move on

    def _hang_cause(self) -> str:
        cfg = self.cfg
        return f"{cfg.health_misses} health checks in a row unanswered in {cfg.health_timeout_s}s"

    def _replace(self, replica: Replica) -> None:
        replica.state = ReplicaState.FAILED
        replica.recovery = self._spawn_task(self._recover(replica))

    async def _recover(self, replica: Replica) -> None:
        provisioner = get_provisioner()
        try:
            await provisioner.check_hosts(replica.mesh)  # before the stop forgets its hosts
        except HostLostError as e:
            replica.lost = e
        await provisioner.stop_procs(replica.mesh)
        replica.mesh = None
        if replica.state is not ReplicaState.FAILED:
            return  # scaled away meanwhile
        if replica.lost is not None:  # on the console: the run has lost capacity for good
            say(f"{self.name} replica {replica.index} not respawned: {replica.lost}")
            await self._set_state(replica, ReplicaState.LOST)
            return
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

    async def _watch(self, replica: Replica) -> None:
        """Health-checks one generation of `replica` until it stops serving.

        Each replica has its own checks, so a hung one delays no other's. A check unanswered
        within `health_timeout_s` is missed and the next follows at once; `health_misses` in a
        row mark the replica hung. While a check waits, the replica's hosts are checked every
        `health_interval_s`: a lost host marks it dead at once. Errors other than a dead
        process are logged and counted, and checking goes on.
        """
        generation, misses = replica.generation, 0
        while True:
            if misses == 0:
                await asyncio.sleep(self.cfg.health_interval_s)
            if not self._is_current(replica, generation):
                return
            try:
                async with asyncio.timeout(self.cfg.health_timeout_s):
                    await self._ping(replica)
                misses = 0
            except TimeoutError:
                misses += 1
                if misses == self.cfg.health_misses:
                    self._mark_hung(replica, generation)
            except (HostLostError, SupervisionError) as e:
                self._mark_dead(replica, generation, e)
            except Exception as e:
                misses = 0  # it answered, with an error: not hung
                self._check_failed(replica, e)
            if replica.generation == generation:  # a respawn's checks count its own misses
                replica.missed_checks = misses

    async def _ping(self, replica: Replica) -> None:
        """The replica's `ping`; raises HostLostError if one of its hosts goes meanwhile
        (Monarch would take far longer to report its processes dead)."""
        ping = replica.actor.ping.call()
        await get_provisioner().probing_hosts(ping, replica.mesh, self.cfg.health_interval_s)

    def _check_failed(self, replica: Replica, error: Exception) -> None:
        replica.metrics.check_errors += 1
        # An ActorError's first line names only the call; the remote exception says why.
        cause = error.exception if isinstance(error, ActorError) else error
        logger.warning(
            "%s replica %d: health check failed, still checking: %s: %s",
            self.name,
            replica.index,
            type(cause).__name__,
            first_line(cause),
        )

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
                await self._healthy_changed.wait_for(lambda: healthy() or self._all_lost())
        except TimeoutError:
            raise NoHealthyReplicaError(
                f"{self.name} service: no healthy replica within {self.cfg.recovery_timeout_s}s"
            ) from None
        if replicas := healthy():
            return replicas
        lost = self._replicas[0].lost
        raise ReplicasLostError(f"{self.name} service: no replica left: {lost}") from lost

    def _all_lost(self) -> bool:
        return bool(self._replicas) and all(r.lost is not None for r in self._replicas)

    async def _route(self, endpoint: ServiceEndpoint, args: tuple, kwargs: dict) -> Any:
        replica = await self._healthy_replica()
        try:
            return await self._call(
                replica, endpoint, args, kwargs, "endpoint not retry_safe, so not retried"
            )
        except ReplicaDiedError:
            if not endpoint.retry_safe:
                raise
        self.retries += 1
        replica = await self._healthy_replica()
        return await self._call(replica, endpoint, args, kwargs, "this was the call's retry")

    async def _call(
        self, replica: Replica, endpoint: ServiceEndpoint, args: tuple, kwargs: dict, note: str
    ) -> Any:
        """One call on `replica`; if the replica dies or hangs, an error naming it and `note`."""
        generation = replica.generation
        where = f"{self.name}.{endpoint.name}: replica {replica.index}"
        try:
            return await replica.call(endpoint.name, args, kwargs)
        except SupervisionError as e:
            self._mark_dead(replica, generation, e)
            raise ReplicaDiedError(f"{where} died during the call ({note})") from e
        except CallAbandoned as e:
            if e.died:
                raise ReplicaDiedError(f"{where} died during the call ({note})") from None
            raise ReplicaHungError(
                f"{where} hung during the call: {self._hang_cause()} ({note})"
            ) from None

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
            elif isinstance(result, CallAbandoned):
                pass  # dead or hung; its respawn catches up through on_recover
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
        """Per-replica state, request and failure counts, health checks missed in a row
        (`missed_checks`), queue depth and latency."""
        return [r.snapshot() for r in self._replicas]

    def replica_actors(self) -> list[Any]:
        """The actor handles of the healthy replicas, in replica order."""
        return [r.actor for r in self._replicas if r.healthy]
