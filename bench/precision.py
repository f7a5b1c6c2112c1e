"""Precision: the GRPO app in float32 (the CPU default) and in bfloat16, alternating, one run.

Each run is the default CPU config, colocated and sync (the same placement for both, so the
precision alone differs), `--steps` steps at `--batch` sequences. float32 and bfloat16 take
turns, `--rounds` times each: this machine's speed drifts between runs. Printed per run:
seconds per step (median of steps 2 on), the trainer's and the generator's tokens per second
and the mismatch KL (median of the same steps); then each figure's bfloat16 / float32 ratio
(the medians over rounds). Worth running only where the CPU computes bfloat16 natively (AMX,
AVX512-BF16); without it bfloat16 matmuls are emulated and far slower.

    python bench/precision.py [--batch 16] [--steps 6] [--rounds 2] [k=v ...]
"""

import argparse
import asyncio
import statistics

from library_log import library_output_to_log
from placement import run
from result import Result
from scratch import scratch_folder

from forge.observability.console import say
from forge.placement import calibration

DTYPES = {
    "float32": ["trainer.dtype=float32", "weight_sync.dtype=float32"],
    "bfloat16": ["trainer.dtype=bfloat16", "weight_sync.dtype=bfloat16"],
}
UNITS = {
    "s/step": "s/step",
    "train tok/s": "tokens/s",
    "gen tok/s": "tokens/s",
    "mismatch KL": "nats",
}
FIGURES = tuple(UNITS)


def figures(result: dict) -> dict[str, float]:
    steps = result["metrics"][1:]  # the first also starts the pipeline

    def median(key: str) -> float:
        return statistics.median(s[key] for s in steps)

    return {
        "s/step": result["measured_s_per_step"],
        "train tok/s": median("train/tokens_per_s"),
        "gen tok/s": median("generator/tokens_per_s"),
        "mismatch KL": median("train/mismatch_kl"),
    }


async def main(args: argparse.Namespace) -> None:
    cache = scratch_folder("calibration") / "calibration.json"
    calibration.cache_path = lambda: cache  # neither reads nor drops the user's cached costs
    placement = ["placement=colocated", "mode=sync"]
    extra = [f"buffer.batch_size={args.batch}", "buffer.capacity=1024", *args.overrides]
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in DTYPES}
    for _ in range(args.rounds):
        for name, dtype in DTYPES.items():
            result = await run(args.config, name, [*placement, *dtype, *extra], args.steps)
            rows[name].append(figures(result))
    say(f"\n{args.batch} sequences per step, colocated, sync, {args.steps} steps a run")
    say(f"{'run':<12}" + "".join(f"{f:>14}" for f in FIGURES))
    for name, runs in rows.items():
        for r in runs:
            say(f"{name:<12}" + "".join(f"{r[f]:>14.3g}" for f in FIGURES))
    ratios = {
        f: statistics.median(r[f] for r in rows["bfloat16"])
        / statistics.median(r[f] for r in rows["float32"])
        for f in FIGURES
    }
    say(f"{'bf16 / fp32':<12}" + "".join(f"{ratios[f]:>14.3g}" for f in FIGURES))
    result = Result("precision")
    for name, runs in rows.items():
        for f, unit in UNITS.items():
            result.figure(f"{name}: {f}, median", statistics.median(r[f] for r in runs), unit)
    for f in FIGURES:
        result.ratio(f"bfloat16 / float32 {f}", ratios[f], headline=f == "s/step")
    result.write()


if __name__ == "__main__":
    library_output_to_log("precision")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo/smollm2_cpu.yaml")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    asyncio.run(main(parser.parse_args()))
