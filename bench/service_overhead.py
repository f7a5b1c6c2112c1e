"""What a service costs over a raw Monarch actor, measured in one run.

Prints the p50 latency of a trivial endpoint called through `service.route` divided by the same
call on the raw actor (target: at most 1.2), and the throughput of 1,000 concurrent calls over
4 replicas, through the service and by hand-rolled round-robin over 4 raw actors.

    python bench/service_overhead.py [--calls 2000]
"""

import argparse
import asyncio
import statistics
import time

from library_log import library_output_to_log
from monarch.actor import endpoint
from result import Result

from forge.controller import ForgeActor, shutdown
from forge.observability.console import say


class Noop(ForgeActor):
    @endpoint
    async def noop(self, x: int) -> int:
        return x


async def p50_ms(call, n: int) -> float:
    latencies = []
    for i in range(n):
        start = time.perf_counter()
        await call(i)
        latencies.append(time.perf_counter() - start)
    return 1000 * statistics.median(latencies)


async def calls_per_s(call, n: int = 1000) -> float:
    start = time.perf_counter()
    results = await asyncio.gather(*(call(i) for i in range(n)))
    elapsed = time.perf_counter() - start
    assert results == list(range(n))
    return n / elapsed


async def main(calls: int) -> None:
    raw = await Noop.as_actor()
    single = await Noop.as_service()
    await p50_ms(raw.noop.call_one, 200)  # warm up both paths
    await p50_ms(single.noop.route, 200)
    # Alternate short blocks so drift on a shared machine hits both paths alike.
    raw_p50, svc_p50 = [], []
    for _ in range(10):
        raw_p50.append(await p50_ms(raw.noop.call_one, calls // 10))
        svc_p50.append(await p50_ms(single.noop.route, calls // 10))
    raw_ms, svc_ms = statistics.median(raw_p50), statistics.median(svc_p50)

    service = await Noop.options(num_replicas=4).as_service()
    raws = [await Noop.as_actor() for _ in range(4)]
    await calls_per_s(service.noop.route)
    await calls_per_s(lambda i: raws[i % 4].noop.call_one(i))
    svc_tput = statistics.median([await calls_per_s(service.noop.route) for _ in range(5)])
    raw_tput = statistics.median(
        [await calls_per_s(lambda i: raws[i % 4].noop.call_one(i)) for _ in range(5)]
    )
    await shutdown()

    say(f"p50 latency, trivial endpoint: raw actor {raw_ms:.3f} ms, service {svc_ms:.3f} ms")
    say(f"service / raw p50 latency ratio: {svc_ms / raw_ms:.3f}  (target <= 1.2)")
    say(
        f"1,000 concurrent calls over 4 replicas: service {svc_tput:,.0f} calls/s, "
        f"raw round-robin {raw_tput:,.0f} calls/s, ratio {svc_tput / raw_tput:.3f}"
    )
    (
        Result("service_overhead")
        .figure("p50 latency, raw actor", raw_ms, "ms")
        .figure("p50 latency, service", svc_ms, "ms")
        .ratio("service / raw actor p50 latency", svc_ms / raw_ms, target="<= 1.2", headline=True)
        .figure("throughput over 4 replicas, service", svc_tput, "calls/s")
        .figure("throughput over 4 replicas, raw round-robin", raw_tput, "calls/s")
        .ratio("service / raw round-robin throughput", svc_tput / raw_tput)
        .write()
    )


if __name__ == "__main__":
    library_output_to_log("service_overhead")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    asyncio.run(main(parser.parse_args().calls))
