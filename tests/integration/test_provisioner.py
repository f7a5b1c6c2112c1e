"""The provisioner on real processes: placement reaches the processes, nothing outlives it."""

import asyncio
import contextlib
import socket

import psutil
import pytest
from helper_actors import Echo
from helper_cgroup import frozen

from forge.controller import (
    ProcessConfig,
    ProvisionerConfig,
    get_provisioner,
    init_provisioner,
    shutdown,
)
from forge.controller.hosts import free_port

pytestmark = pytest.mark.integration


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def host_workers(pids: set[int]) -> set[int]:
    """The emulated hosts' worker processes among `pids`."""
    found = set()
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if "run_worker_loop_forever" in " ".join(psutil.Process(pid).cmdline()):
                found.add(pid)
    return found


async def test_env_and_cpu_pinning_reach_the_process():
    try:
        actor = await Echo.options(procs=1, cpus_per_proc=1, env={"FORGE_TEST": "yes"}).as_actor()
        info = await actor.info.call_one()
        assert info["env"]["FORGE_TEST"] == "yes"
        assert info["affinity"] == [int(info["env"]["FORGE_CPUS"])]
        assert info["threads"] == 1 and info["env"]["OMP_NUM_THREADS"] == "1"
        other = await Echo.options(procs=1, cpus_per_proc=1).as_actor()
        other_info = await other.info.call_one()
        assert other_info["affinity"] != info["affinity"]  # disjoint pools
        await Echo.shutdown(other)
        assert get_provisioner().num_procs == 1
    finally:
        await shutdown()


async def test_two_proc_mesh_ranks():
    try:
        actor = await Echo.options(procs=2).as_actor()
        envs = [i["env"] for i in (await actor.info.call()).values()]
        assert sorted(e["RANK"] for e in envs) == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert len({e["MASTER_PORT"] for e in envs}) == 1
    finally:
        await shutdown()


async def test_multi_host_mesh_on_emulated_hosts_and_no_orphans():
    before = descendants()
    init_provisioner(ProvisionerConfig(launcher="process", hosts=2))
    try:
        actor = await Echo.options(procs=1, hosts=2).as_actor()
        envs = [i["env"] for i in (await actor.info.call()).values()]
        assert sorted(e["RANK"] for e in envs) == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
        service = await Echo.options(num_replicas=2).as_service()
        assert len({i["pid"] for i in await service.info.fanout()}) == 2
        assert len(host_workers(descendants() - before)) == 2
    finally:
        await shutdown()
    assert await _settled(before)


async def test_shutdown_stops_every_process_it_started():
    before = descendants()
    await Echo.options(num_replicas=3).as_service()
    await Echo.options(procs=2).as_actor()
    assert len(descendants() - before) >= 5
    await shutdown()
    assert await _settled(before)


async def test_a_failing_shutdown_stops_the_rest_then_raises():
    """Everything stops at once; one thing's error does not leave the others running."""

    class Broken:
        async def shutdown(self) -> None:
            raise RuntimeError("broken on purpose")

    before = descendants()
    await Echo.options(num_replicas=2).as_service()
    get_provisioner().own(Broken())
    await Echo.options(procs=1).as_actor()
    with pytest.raises(RuntimeError, match="broken on purpose"):
        await shutdown()
    assert get_provisioner().num_procs == 0
    assert await _settled(before)


async def test_a_mesh_stopped_twice_at_once_stops_once_and_gives_its_cores_back_once():
    """A failed start's cleanup and the run's close may stop one mesh together."""
    before = descendants()
    provisioner = get_provisioner()
    try:
        mesh = await provisioner.spawn_procs(ProcessConfig(cpus_per_proc=1))
        assert provisioner.num_procs == 1
        await asyncio.gather(provisioner.stop_procs(mesh), provisioner.stop_procs(mesh))
        assert provisioner.num_procs == 0
        again = await provisioner.spawn_procs(ProcessConfig(cpus_per_proc=1))  # the core is free
        await provisioner.stop_procs(again)
    finally:
        await shutdown()
    assert await _settled(before)


async def test_a_process_starved_past_monarchs_default_wait_is_not_reported_dead():
    """A live process that cannot run for longer than torchmonarch's default wait (30 s, then
    "The process likely crashed") answers its pending call once it runs again."""
    try:
        actor = await Echo.options(procs=1).as_actor()
        pid, _ = await actor.work.call_one(0)
        with frozen(pid):  # as starved as a process can be
            pending = asyncio.ensure_future(actor.work.call_one(1))
            # The stimulus itself, not a wait for a condition: stalled past the default wait
            # plus Monarch's 10 s supervision poll.
            await asyncio.sleep(45)
            assert not pending.done(), pending
        assert await pending == (pid, 1)
    finally:
        await shutdown()


def test_rendezvous_ports_are_free_and_below_the_ephemeral_range():
    """An outgoing connection cannot take the port before the trainer binds it."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports) and len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))


async def _settled(before: set[int], timeout: float = 10.0) -> bool:
    async with asyncio.timeout(timeout):
        while descendants() - before:
            await asyncio.sleep(0.1)
    return True
