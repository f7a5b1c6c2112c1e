"""Placement: each placement's seconds per step, measured, beside the planner's prediction.

For each batch size (sequences per step) it runs the GRPO app in this process on the default CPU
config, in each mode (sync, then async) with each placement: `auto` first (the first calibrates,
into a calibration cache of this run's own, and picks), then colocated and split (each predicted
from that calibration). Seconds per step are the median of steps 2-6, from the run's elapsed
time at each step's end (the first step also starts the pipeline; steps 2-3 still grow the
trainer's heap, so five steps keep a slow one from deciding the comparison). It prints one table
per batch size: measured, predicted, their ratio; per mode, whether auto is within 5% of the
better fixed placement measured in that mode; and the colocated trainer's FLOP rate (6 x
parameters x tokens / training time, median of steps 2-6) against a matmul in the trainer's
dtype on the same cores, measured in this process just before and just after that run (their
mean).

    python bench/placement.py [--sizes 16 64] [--config ...] [k=v ...]
"""

import argparse
import asyncio
import json
import math
import statistics
from pathlib import Path

import torch
from async_speedup import seconds_per_step
from library_log import library_output_to_log
from result import Result
from scratch import scratch_folder
from trainer_memory import matmul_flops

from forge.cli import load_app
from forge.config import load_config
from forge.models import resolve_model
from forge.observability.console import say
from forge.placement import calibration
from forge.placement.cost_model import Prediction

APP = Path(__file__).parents[1] / "apps" / "grpo" / "main.py"
STEPS = 6
MODES = ("sync", "async")
PLACEMENTS = ("auto", "colocated", "split")


async def run(config: str, name: str, overrides: list[str], steps: int = STEPS) -> dict:
    """One run of `steps` steps; its pipeline.json (prediction, measured), its metrics and its
    folder."""
    app_main, schema = load_app(APP)
    run_dir = scratch_folder(name)
    quiet = ["eval.interval=0", "export_hf=false", "trainer.checkpoint.enabled=false"]
    cfg = load_config(schema, config, [*quiet, *overrides, f"steps={steps}", f"run_dir={run_dir}"])
    say(f"{name}: {' '.join(overrides)} -> {run_dir}")
    await app_main(cfg)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = seconds_per_step(metrics)
    # Written where a prediction was made: under auto, or with the phase costs cached.
    path = run_dir / "pipeline.json"
    pipeline = json.loads(path.read_text()) if path.exists() else {}
    return {**pipeline, "measured_s_per_step": measured, "metrics": metrics, "run_dir": run_dir}


def parameters(config: str) -> int:
    from safetensors import safe_open

    cfg = load_config(load_app(APP)[1], config, [])
    total = 0
    for file in Path(resolve_model(cfg.trainer.model)).glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


async def size(config: str, batch: int, overrides: list[str], params: int, result: Result) -> None:
    extra = [f"buffer.batch_size={batch}", "buffer.capacity=1024", *overrides]
    dtype = load_config(load_app(APP)[1], config, overrides).trainer.dtype
    results = {}
    for mode in MODES:
        for placement in PLACEMENTS:
            name = f"{placement}-{mode}"
            if name == "colocated-sync":
                # This process holds the same cores the trainer will.
                before = matmul_flops(dtype=getattr(torch, dtype))
            overrides = [f"placement={placement}", f"mode={mode}", *extra]
            results[name] = await run(config, name, overrides)
            if name == "colocated-sync":
                # The machine's rate drifts: both sides.
                matmul = (before + matmul_flops(dtype=getattr(torch, dtype))) / 2
    say(f"\n{batch} sequences per step")
    say(f"{'placement':<16}{'chosen':<12}{'measured':>10}{'predicted':>11}{'ratio':>8}")
    for name, r in results.items():
        measured, predicted = r["measured_s_per_step"], r["chosen"]["seconds_per_step"]
        label = Prediction(**r["chosen"]).label
        say(
            f"{name:<16}{label:<12}{measured:>9.1f}s{predicted:>10.1f}s{measured / predicted:>8.2f}"
        )
        row = f"{batch} sequences, {name} ({label})"
        result.figure(f"{row}: measured", measured, "s/step")
        result.figure(f"{row}: predicted", predicted, "s/step")
        result.ratio(f"{row}: measured / predicted", measured / predicted)
    for mode in MODES:
        fixed = min(results[f"{p}-{mode}"]["measured_s_per_step"] for p in PLACEMENTS[1:])
        auto = results[f"auto-{mode}"]["measured_s_per_step"]
        say(f"{mode}: auto / better fixed placement: {auto / fixed:.3f} (target <= 1.05)")
        result.ratio(
            f"{batch} sequences, {mode}: auto / better fixed placement",
            auto / fixed,
            target="<= 1.05",
        )
    steps = results["colocated-sync"]["metrics"][1:]
    flops = statistics.median(6 * params * s["train/tokens_per_s"] for s in steps)
    say(
        f"colocated trainer: {flops / 1e9:.1f} GFLOP/s = {flops / matmul:.2f} of a "
        f"{torch.get_num_threads()}-thread {dtype} matmul ({matmul / 1e9:.0f} GFLOP/s; target "
        ">= 0.8)\n",
    )
    result.figure(f"{batch} sequences: colocated trainer", flops / 1e9, "GFLOP/s")
    result.figure(f"{batch} sequences: {dtype} matmul, same cores", matmul / 1e9, "GFLOP/s")
    result.ratio(
        f"{batch} sequences: colocated trainer FLOP rate / matmul rate",
        flops / matmul,
        target=">= 0.8",
    )


async def main(args: argparse.Namespace) -> None:
    cache = scratch_folder("calibration") / "calibration.json"
    calibration.cache_path = lambda: cache  # auto calibrates in this run, whatever is cached
    # Every placement is predicted from the costs auto measured, even where one run's measured
    # figure is far enough off them that a run would drop them from the cache.
    calibration.forget = lambda key: None
    params = parameters(args.config)
    result = Result("placement")
    for batch in args.sizes:
        await size(args.config, batch, args.overrides, params, result)
    result.write()


if __name__ == "__main__":
    library_output_to_log("placement")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo/smollm2_cpu.yaml")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    asyncio.run(main(parser.parse_args()))
