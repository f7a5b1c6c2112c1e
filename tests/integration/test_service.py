"""Services on real Monarch processes: routing, sessions, fanout, failures, recovery, scaling."""

import asyncio
import collections
import os
import signal

import psutil
import pytest
from helper_actors import BadSetup, BrokenPing, Echo
from helper_runs import wait_until
from monarch.actor import ActorError

from forge.controller import ServiceConfig, get_provisioner, shutdown
from forge.controller.service import ReplicaDiedError, ReplicaHungError

pytestmark = pytest.mark.integration


@pytest.fixture
async def provisioner():
    yield get_provisioner()
    await shutdown()


async def replica_pids(service) -> list[int]:
    return [info["pid"] for info in await service.info.fanout()]


async def test_round_robin_spreads_calls_evenly(provisioner):
    service = await Echo.options(num_replicas=3).as_service()
    results = await asyncio.gather(*(service.work.route(i) for i in range(31)))
    assert [x for _, x in results] == list(range(31))
    counts = collections.Counter(pid for pid, _ in results)
    assert sorted(counts) == sorted(await replica_pids(service))
    assert max(counts.values()) - min(counts.values()) <= 1, counts


async def test_least_loaded_prefers_the_idle_replica(provisioner):
    service = await Echo.options(num_replicas=2, routing="least_loaded").as_service()
    busy = asyncio.ensure_future(service.work.route(0, 2.0))
    await wait_until(lambda: sum(m["in_flight"] for m in service.metrics()) == 1, "busy call")
    pids = {(await service.work.route(i))[0] for i in range(5)}
    busy_pid, _ = await busy
    assert busy_pid not in pids and len(pids) == 1


async def test_session_sticks_to_one_replica(provisioner):
    service = await Echo.options(num_replicas=3).as_service()

    async def one_session() -> set[int]:
        async with service.session():
            return {(await service.work.route(i))[0] for i in range(6)}

    sessions = await asyncio.gather(*(one_session() for _ in range(3)))
    assert all(len(pids) == 1 for pids in sessions)
    # Three sessions started together land on three replicas: stickiness, not one favourite.
    assert len(set.union(*sessions)) == 3


async def test_fanout_reaches_every_healthy_replica(provisioner):
    service = await Echo.options(num_replicas=3).as_service("fan")
    infos = await service.info.fanout()
    assert len({i["pid"] for i in infos}) == 3
    assert all(i["tag"] == "fan" and i["setup_done"] for i in infos)


async def test_endpoint_error_reaches_caller_and_replica_keeps_serving(provisioner):
    service = await Echo.options(num_replicas=2).as_service()
    with pytest.raises(ValueError, match="^bad row 17$") as raised:
        await service.fail.route("bad row 17")
    assert isinstance(raised.value.__cause__, ActorError)  # with the remote traceback
    results = await asyncio.gather(*(service.work.route(i) for i in range(10)))
    assert len({pid for pid, _ in results}) == 2
    metrics = service.metrics()
    assert sum(m["errors"] for m in metrics) == 1
    assert all(m["state"] == "healthy" and m["deaths"] == 0 for m in metrics)


async def test_per_replica_cap_queues_requests(provisioner):
    service = await Echo.options(num_replicas=1, max_concurrent=3).as_service()
    calls = [asyncio.ensure_future(service.work.route(i, 0.3)) for i in range(9)]

    def arrived() -> bool:  # every call is at the replica, or one has already finished
        (m,) = service.metrics()
        return m["in_flight"] + m["queued"] == 9 or m["requests"] > 0

    await wait_until(arrived, "9 calls at the replica")
    (m,) = service.metrics()
    assert (m["in_flight"], m["queued"], m["requests"]) == (3, 6, 0)
    await asyncio.gather(*calls)
    (info,) = await service.info.fanout()
    assert info["max_running"] == 3


async def test_sigkill_under_load_loses_no_retry_safe_call(provisioner):
    service = await Echo.options(num_replicas=2, health_interval_s=0.5).as_service()
    current_version = 7

    async def on_recover(actor) -> None:
        await actor.recover_to.call(current_version)

    service.on_recover = on_recover
    victim_actor = service.replica_actors()[0]
    victim = (await victim_actor.info.call_one())["pid"]
    safe = [asyncio.ensure_future(service.work.route(i, 1.0)) for i in range(200)]
    unsafe = [asyncio.ensure_future(service.unsafe_work.route(i, 1.0)) for i in range(10)]

    async def victim_busy() -> bool:
        return (await victim_actor.info.call_one())["max_running"] > 0

    # Killed while it runs calls, with its share of the unsafe ones queued behind them.
    await wait_until(victim_busy, "calls running on the victim", poll=0.05)
    os.kill(victim, signal.SIGKILL)

    assert [x for _, x in await asyncio.gather(*safe)] == list(range(200))
    unsafe_results = await asyncio.gather(*unsafe, return_exceptions=True)
    died = [r for r in unsafe_results if isinstance(r, BaseException)]
    assert died and all(isinstance(e, ReplicaDiedError) for e in died)
    assert all("\n" not in str(e) and "not retry_safe" in str(e) for e in died)
    assert service.retries >= 1

    await wait_until(lambda: service.metrics()[0]["recoveries"] == 1)
    infos = await service.info.fanout()
    assert victim not in {i["pid"] for i in infos} and len(infos) == 2
    respawned = next(i for i in infos if i["recovered_to"] is not None)
    assert respawned["recovered_to"] == current_version and respawned["setup_done"]
    (m0, m1) = service.metrics()
    assert (m0["deaths"], m0["state"], m1["deaths"]) == (1, "healthy", 0)
    results = await asyncio.gather(*(service.work.route(i) for i in range(10)))
    assert {pid for pid, _ in results} == {i["pid"] for i in infos}


async def test_scale_up_and_down_under_load_loses_no_call(provisioner):
    service = await Echo.options(num_replicas=2).as_service()
    stop = asyncio.Event()
    done: list[int] = []

    async def client(cid: int) -> None:
        i = 0
        while not stop.is_set():
            _, x = await service.work.route(cid * 100_000 + i, 0.02)
            done.append(x)
            i += 1

    clients = [asyncio.ensure_future(client(c)) for c in range(16)]
    await service.scale(4)
    assert service.num_healthy == 4
    # Every new replica takes traffic (the clients' calls interleave with any probe of ours, so
    # count what each replica served instead of probing round-robin).
    await wait_until(lambda: all(m["requests"] for m in service.metrics()))
    await service.scale(1)
    assert service.num_healthy == 1 and len(service.metrics()) == 1
    # The clients' calls go on, served by the replica left.
    served = service.metrics()[0]["requests"]
    await wait_until(lambda: service.metrics()[0]["requests"] >= served + 2 * len(clients))
    stop.set()
    await asyncio.gather(*clients)  # any lost call would raise here
    assert len(done) == len(set(done)) > 100
    assert provisioner.num_procs == 1


async def test_setup_error_reaches_caller_and_leaves_no_process(provisioner):
    with pytest.raises(ActorError, match="no model at /nowhere"):
        await BadSetup.options(num_replicas=2).as_service()
    assert provisioner.num_procs == 0


async def test_hung_replica_is_detected_failed_over_and_replaced(provisioner, tmp_path):
    interval, deadline, misses = 0.5, 1.0, 3
    service = await Echo.options(
        num_replicas=2,
        health_interval_s=interval,
        health_timeout_s=deadline,
        health_misses=misses,
    ).as_service()

    async def on_recover(actor) -> None:
        await actor.recover_to.call(7)

    service.on_recover = on_recover
    hung_actor, healthy_actor = service.replica_actors()
    hung_pid = (await hung_actor.info.call_one())["pid"]
    healthy_pid = (await healthy_actor.info.call_one())["pid"]
    marker = tmp_path / "hanging"
    hang = asyncio.ensure_future(hung_actor.hang.call_one(str(marker)))
    await wait_until(marker.exists)
    # Round-robin puts every other call on replica 0, where it is stuck behind the hang.
    safe = [asyncio.ensure_future(service.work.route(i)) for i in range(6)]
    unsafe = [asyncio.ensure_future(service.unsafe_work.route(i)) for i in range(6)]

    # Detection takes exactly `misses` missed checks in a row: the replica still serves after
    # one fewer (the poll also stops if it was marked hung meanwhile, so that the assert says so).
    def one_miss_short() -> bool:
        m = service.metrics()[0]
        return m["missed_checks"] == misses - 1 or m["state"] != "healthy"

    await wait_until(one_miss_short, f"{misses - 1} missed health checks")
    m = service.metrics()[0]
    assert (m["state"], m["missed_checks"], m["hangs"]) == ("healthy", misses - 1, 0)
    await wait_until(lambda: service.metrics()[0]["state"] != "healthy", "the hang detected")
    m = service.metrics()[0]
    assert (m["missed_checks"], m["hangs"]) == (misses, 1)

    # The stuck retry-safe calls completed on the healthy replica; stuck unsafe ones failed.
    assert await asyncio.gather(*safe) == [(healthy_pid, i) for i in range(6)]
    assert service.retries == 3
    unsafe_results = await asyncio.gather(*unsafe, return_exceptions=True)
    failed = [r for r in unsafe_results if isinstance(r, BaseException)]
    served = {r for r in unsafe_results if not isinstance(r, BaseException)}
    assert len(failed) == 3 and all(isinstance(e, ReplicaHungError) for e in failed), failed
    for e in failed:
        assert str(e).startswith("Echo.unsafe_work: replica 0 hung during the call: ")
        assert "\n" not in str(e) and "not retry_safe" in str(e)
    assert served == {(healthy_pid, i) for i in (1, 3, 5)}

    # Calls made after detection go to the healthy replica only (no retries), while the
    # replacement is still starting (stopping the blocked process alone takes seconds).
    after = await asyncio.gather(*(service.work.route(i) for i in range(10)))
    assert {pid for pid, _ in after} == {healthy_pid} and service.retries == 3
    assert service.metrics()[0]["state"] != "healthy"

    await wait_until(lambda: service.metrics()[0]["recoveries"] == 1)
    await wait_until(lambda: not psutil.pid_exists(hung_pid))
    assert isinstance((await asyncio.gather(hang, return_exceptions=True))[0], Exception)
    infos = await service.info.fanout()
    (new,) = [i for i in infos if i["pid"] != healthy_pid]
    assert new["recovered_to"] == 7 and new["setup_done"]
    m0, m1 = service.metrics()
    assert (m0["state"], m0["hangs"], m0["deaths"], m1["hangs"]) == ("healthy", 1, 0, 0)
    results = await asyncio.gather(*(service.work.route(i) for i in range(10)))
    assert {pid for pid, _ in results} == {new["pid"], healthy_pid}


async def test_health_checks_survive_errors_and_still_catch_a_hang(provisioner, tmp_path):
    service = await BrokenPing.options(
        health_interval_s=0.2, health_timeout_s=1.0, health_misses=2
    ).as_service()
    (actor,) = service.replica_actors()
    await actor.fail_pings.call_one(3)
    await wait_until(lambda: service.metrics()[0]["check_errors"] == 3)
    assert service.metrics()[0]["state"] == "healthy"

    # The same checks still act: a hang is caught and the replica replaced.
    hang = asyncio.ensure_future(actor.hang.call_one(str(tmp_path / "hanging")))
    await wait_until(lambda: service.metrics()[0]["recoveries"] == 1)
    assert isinstance((await asyncio.gather(hang, return_exceptions=True))[0], Exception)
    (m,) = service.metrics()
    assert (m["state"], m["check_errors"], m["hangs"], m["deaths"]) == ("healthy", 3, 1, 0)
    assert (await service.work.route(5))[1] == 5


def test_health_settings_are_validated():
    with pytest.raises(ValueError, match="^health_misses must be >= 1, got 0$"):
        ServiceConfig(health_misses=0)
    with pytest.raises(ValueError, match="^health_timeout_s must be > 0, got 0$"):
        ServiceConfig(health_timeout_s=0)
