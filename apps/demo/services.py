"""A tour of services on real processes: routing, a replica killed and recovered, scaling.

python apps/demo/services.py
"""

import asyncio
import collections
import os
import signal
import time

from monarch.actor import endpoint
from monarch.actor.concurrent import concurrent_endpoint

from forge.controller import ForgeActor, retry_safe, shutdown


class Worker(ForgeActor):
    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    @concurrent_endpoint
    @retry_safe
    async def work(self, x: int) -> tuple[int, int]:
        await asyncio.sleep(0.5)
        return os.getpid(), x * x

    @endpoint
    async def set_version(self, version: int) -> None:
        self.version = version

    @endpoint
    async def version_of(self) -> tuple[int, int]:
        return os.getpid(), self.version


def say(start: float, message: str) -> None:
    print(f"[{time.perf_counter() - start:6.1f}s] {message}", flush=True)


async def main() -> None:
    start = time.perf_counter()
    service = await Worker.options(num_replicas=3, health_interval_s=0.5).as_service()
    say(start, f"service up: {service.num_healthy} replicas")

    results = await asyncio.gather(*(service.work.route(i) for i in range(30)))
    spread = collections.Counter(pid for pid, _ in results)
    say(start, f"30 calls, round-robin, calls per replica process: {dict(spread)}")

    async with service.session():
        pids = {(await service.work.route(i))[0] for i in range(3)}
    say(start, f"a session's 3 calls all went to process {pids}")

    await service.set_version.fanout(1)
    service.on_recover = lambda actor: actor.set_version.call(1)
    say(start, f"fanout set version 1 on {len(await service.version_of.fanout())} replicas")

    victim = results[0][0]
    calls = [asyncio.ensure_future(service.work.route(i)) for i in range(200)]
    await asyncio.sleep(0.2)
    os.kill(victim, signal.SIGKILL)
    say(start, f"SIGKILL to replica process {victim} with 200 calls in flight")
    done = await asyncio.gather(*calls)
    say(start, f"all {len(done)} calls answered; {service.retries} retried on a healthy replica")
    while sum(m["recoveries"] for m in service.metrics()) == 0:
        await asyncio.sleep(0.2)
    say(start, f"respawned replica is back; versions: {await service.version_of.fanout()}")

    await service.scale(5)
    say(start, f"scaled up to {service.num_healthy} replicas")
    load = [asyncio.ensure_future(service.work.route(i)) for i in range(100)]
    await service.scale(1)
    await asyncio.gather(*load)
    say(start, f"scaled down to {service.num_healthy} replica under load; 100/100 calls answered")
    for m in service.metrics():
        say(start, f"metrics: {m}")
    await shutdown()
    say(start, "shut down: no process left")


if __name__ == "__main__":
    asyncio.run(main())
