"""Generator replicas behind a service: one is SIGKILLed under load, the service keeps serving,
and the respawned replica catches up to the current weights before it takes traffic."""

import asyncio
import os
import signal

import psutil
import pytest
from helper_runs import wait_until
from transformers import AutoModelForCausalLM

from forge.actors.generator import Generator, GeneratorConfig
from forge.controller import shutdown
from forge.models import tiny_model
from forge.weights.shm_transport import SharedMemoryTransport
from forge.weights.sync_config import WeightSyncConfig
from forge.weights.transport import TransportConfig

pytestmark = pytest.mark.integration


def engine_processes() -> list[psutil.Process]:
    """This test process's vLLM engines (other tests may run engines of their own meanwhile)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "EngineCore" in p.name() + " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass  # ended meanwhile
    return found


async def test_killed_replica_is_respawned_on_current_weights(tmp_path):
    transport = SharedMemoryTransport(tmp_path / "weights")
    cfg = GeneratorConfig(
        model=str(tiny_model("llama", seed=0, init_std=0.5)),
        max_model_len=512,
        kv_cache_mb=64,
    )
    sync = WeightSyncConfig(TransportConfig(path=str(transport.root)))
    engines_before = {p.pid for p in engine_processes()}
    try:
        service = await Generator.options(
            num_replicas=2, health_interval_s=0.5, env={"OMP_NUM_THREADS": "1"}
        ).as_service(cfg, sync)
        service.on_recover = lambda actor: actor.load_latest.call()
        new = AutoModelForCausalLM.from_pretrained(tiny_model("llama", seed=1, init_std=0.5))
        weights = {k: v for k, v in new.state_dict().items() if k != "lm_head.weight"}
        await transport.publish(1, weights)
        assert [r["mode"] for r in await service.update_weights.fanout(1)] == ["drain"] * 2

        victim = service.replica_actors()[0]
        pids = [await actor.ping.call_one() for actor in service.replica_actors()]
        sampling = {"max_tokens": 64, "ignore_eos": True}
        made = (await victim.stats.call_one())["tokens_total"]
        calls = [
            asyncio.ensure_future(service.generate.route(f"request {i}", sampling=sampling))
            for i in range(24)
        ]

        async def victim_generating() -> bool:  # its engine makes tokens for calls still open
            stats = await victim.stats.call_one()
            return stats["tokens_total"] > made and service.metrics()[0]["in_flight"] > 0

        await wait_until(victim_generating, "tokens from replica 0", timeout=120, poll=0.05)
        os.kill(pids[0], signal.SIGKILL)
        results = await asyncio.gather(*calls)
        assert all(len(c.token_ids) == 64 for r in results for c in r)
        assert service.retries >= 1  # the kill cut calls short, and they were retried

        async with asyncio.timeout(120):
            while sum(m["recoveries"] for m in service.metrics()) < 1:
                await asyncio.sleep(0.5)
        assert await service.get_version.fanout() == [1, 1]
        assert pids[0] not in [await a.ping.call_one() for a in service.replica_actors()]
        (c,) = await service.generate.route("after", sampling={"max_tokens": 4})
        assert c.token_versions == [1] * 4
        # The killed replica's engine process died with it: no orphan holds the cores.
        async with asyncio.timeout(30):
            while len({p.pid for p in engine_processes()} - engines_before) != 2:
                await asyncio.sleep(0.5)
    finally:
        await shutdown()
    async with asyncio.timeout(30):
        while {p.pid for p in engine_processes()} - engines_before:
            await asyncio.sleep(0.5)
