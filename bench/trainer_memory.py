"""Trainer memory against batch size at a fixed micro-batch, and its FLOP rate against a matmul.

One TitanTrainer (SmolLM2-135M, fp32) takes a GRPO step on batches of 16, 64 and 256 sequences
of GRPO's shape (a ~40-token prompt, 32 sampled tokens), `--micro-batch` sequences per forward
and backward pass. Printed, from this one run: the trainer's peak resident memory per batch
size (and its ratio to the 16-sequence figure), and the trainer's FLOP rate
(6 x parameters x tokens / step time) as a fraction of a 2048^3 fp32 matmul's on the same cores.
The simplest alternative, one pass over the whole batch (`--micro-batch 0`), is run for the
batch sizes that fit in `--whole-up-to`.

    python bench/trainer_memory.py [--micro-batch 8] [--logits-chunk 512] [--sizes 16 64 256]
"""

import argparse
import asyncio
import random
import time

import torch
from library_log import library_output_to_log
from result import Result

from forge.actors.trainer import TitanTrainer, TrainerConfig
from forge.controller import shutdown
from forge.data import Completion, Episode
from forge.models import smollm2
from forge.models.titan import load_pretrained
from forge.observability.console import say


def batch(n: int, seed: int) -> list[Episode]:
    """GRPO-shaped episodes: groups of 8 with random advantages (fresh data: ratio 1)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(49152) for _ in range(rng.randint(36, 44))]
        tokens = [rng.randrange(49152) for _ in range(32)]
        completion = Completion(prompt, tokens, "", [-10.8] * 32, [0] * 32, "")
        out.append(Episode(f"{seed}-{i}", f"{seed}-{i // 8}", completion, advantage=rng.gauss()))
    return out


def matmul_flops(size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a [size, size] @ [size, size] in `dtype` on this process's cores (best of)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up: thread pool, caches
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


async def measure(micro_batch: int, chunk: int, sizes: list[int]) -> list[dict[str, float]]:
    """One warm-up step, then one step per batch size: peak RSS, tokens and seconds."""
    cfg = TrainerConfig(
        model=str(smollm2()), micro_batch_size=micro_batch, logits_chunk_tokens=chunk
    )
    trainer = await TitanTrainer.as_actor(cfg)
    await trainer.train_step.call_one([batch(8, seed=0)])
    rows = []
    for size in sizes:
        # The machine's speed drifts (shared cores): each step gets the matmul rate just before it.
        flops = matmul_flops()
        start = time.perf_counter()
        m = await trainer.train_step.call_one([batch(size, seed=size)])
        rows.append(
            {"size": size, "peak": m["peak_rss_gb"], "tokens": m["tokens"]}
            | {"seconds": time.perf_counter() - start, "flops": flops}
        )
    await TitanTrainer.shutdown(trainer)
    return rows


def report(name: str, rows: list[dict[str, float]], params: int, result: Result) -> None:
    base = rows[0]["peak"]
    for r in rows:
        rate = 6 * params * r["tokens"] / r["seconds"]
        say(
            f"{name:>14} | {r['size']:4d} sequences | peak RSS {r['peak']:5.2f} GB "
            f"({r['peak'] / base:4.2f} x the {rows[0]['size']}-sequence figure) | "
            f"{r['tokens'] / r['seconds']:6.0f} tokens/s = {rate / r['flops']:4.2f} x the matmul "
            f"rate ({r['flops'] / 1e9:.0f} GFLOP/s, measured before the step)"
        )
        row = f"{name}, {r['size']} sequences"
        result.figure(f"{row}: trainer peak RSS", r["peak"], "GB")
        result.ratio(f"{row}: peak RSS / {rows[0]['size']} sequences'", r["peak"] / base)
        result.figure(f"{row}: trained", r["tokens"] / r["seconds"], "tokens/s")
        result.ratio(f"{row}: FLOP rate / matmul rate", rate / r["flops"])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=8)  # the CPU configs'
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--whole-up-to", type=int, default=64)
    parser.add_argument("--logits-chunk", type=int, default=512)  # the CPU configs'
    args = parser.parse_args()
    params = sum(p.numel() for p in load_pretrained(smollm2()).parameters())
    say(f"SmolLM2-135M: {params / 1e6:.1f}M parameters")
    try:
        micro = await measure(args.micro_batch, args.logits_chunk, args.sizes)
        whole = await measure(
            0, args.logits_chunk, [s for s in args.sizes if s <= args.whole_up_to]
        )
    finally:
        await shutdown()
    result = Result("trainer_memory")
    report(f"micro-batch {args.micro_batch}", micro, params, result)
    if whole:
        report("whole batch", whole, params, result)
    result.write()


if __name__ == "__main__":
    library_output_to_log("trainer_memory")
    asyncio.run(main())
