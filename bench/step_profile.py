"""Where a GRPO step's time goes: `make grpo`'s config at 16 and 64 sequences a step, colocated and
split, each step taken apart, and the trainer's FLOP rate against a fixed-shape step.

For each batch size and placement it runs the GRPO app (the config's mode) for `--steps` steps
and takes the median over steps 2..N-1 (the first also starts the pipeline, the last waits for
the final update) of each part of a step as the training loop lives it, in order: waiting for a
batch (the generation and scoring the loop waited for), the trainer's collation, its forward
passes under the previous weights (the exact mismatch), forward and backward passes, keeping the
weights for the next step's mismatch, the optimizer (clipping included), the trainer's other
work, the batch record's parameter digests, the train call beyond the trainer's own work (moving
the batch), publishing a version (gather and write), waiting for the generators' update (fetch,
prepare, pause, swap), and the rest of the step. They add up to the step (s/step, from the run's
elapsed time). Beside them, the overlapped work: the generators' busy seconds, reward scoring
(summed over groups), and the generators' prepare, pause and swap.

FLOP rates (6, 2 and 4 x parameters x tokens for a step, a forward and a backward pass; tokens
as the trainer counts them, padding left out) are given as a fraction of a fixed-shape step
(`bench/trainer_flops.py`'s: two micro-batches of 8 x 80 tokens, clipping and AdamW), measured
in a process of its own on as many threads as the run's trainer had, just after the run. Draws one
stacked bar per run: bench/results/step_profile.png.

    python bench/step_profile.py [--sizes 16 64] [--placements colocated split] [--steps 6]
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from async_speedup import steady_seconds_per_step
from library_log import library_output_to_log
from placement import APP, parameters, run
from result import FOLDER, Result

from forge.cli import load_app
from forge.config import load_config
from forge.observability.console import say
from forge.observability.timeline import read_timeline

CONFIG = "configs/grpo/smollm2_cpu.yaml"
TRAINER_PARTS = ("collate", "previous", "forward", "backward", "keep", "optimizer", "other")
# The parts of a step on the loop's critical path, in order, with their colours.
PARTS = {
    "batch wait": "tab:green",
    "collate": "tab:gray",
    "previous": "tab:olive",
    "forward": "tab:blue",
    "backward": "navy",
    "keep": "tab:cyan",
    "optimizer": "tab:purple",
    "other": "silver",
    "digest": "wheat",
    "call": "tab:pink",
    "push": "tab:orange",
    "update wait": "tab:red",
    "rest": "whitesmoke",
}


def median(steps: list[dict], key: str) -> float:
    return statistics.median(s.get(key, 0.0) for s in steps)


def steady(metrics: list[dict]) -> list[dict]:
    """Steps 2..N-1: the first also starts the pipeline, the last waits for the final update."""
    return metrics[1:-1]


def step_parts(metrics: list[dict]) -> dict[str, float]:
    """Median seconds of each critical-path part over the steady steps, and of the step."""
    steps = steady(metrics)
    step_s = steady_seconds_per_step(metrics)
    parts = {"batch wait": median(steps, "train/batch_wait_s")}
    parts |= {p: median(steps, f"train/{p}_s") for p in TRAINER_PARTS}
    trained = sum(parts[p] for p in TRAINER_PARTS)
    parts["digest"] = median(steps, "train/digest_s")  # the batch record's, around the step
    parts["call"] = max(median(steps, "train/call_s") - trained - parts["digest"], 0.0)
    parts["push"] = median(steps, "weights/push_s")
    parts["update wait"] = max(median(steps, "weights/sync_s") - parts["push"], 0.0)
    parts["rest"] = max(step_s - sum(parts.values()), 0.0)
    return {**parts, "step": step_s, "trained": trained}


def generator_busy(run_dir: Path, steps: int) -> float:
    """The generators' seconds generating (rollouts), per steady step."""
    spans = [s for s in read_timeline(run_dir) if s["what"] == "generate" and 1 < s["step"] < steps]
    return sum(s["end"] - s["start"] for s in spans) / max(steps - 2, 1)


def fixed_shape_rate(threads: int, params: int) -> float:
    """6 x parameters x tokens / time of the fixed-shape step on `threads` threads, in a process
    of its own: this one ran the app's driver, and a model and thread pool left here would
    disturb the next run."""
    code = (
        f"import json, torch; torch.set_num_threads({threads}); "
        "from trainer_flops import fixed_step_seconds; print(json.dumps(fixed_step_seconds()))"
    )
    here = Path(__file__).parent
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=here, capture_output=True, text=True, check=True
    )
    seconds, tokens = json.loads(out.stdout.splitlines()[-1])
    return 6 * params * tokens / seconds


async def profile(batch: int, placement: str, steps: int, params: int, result: Result) -> dict:
    overrides = [f"placement={placement}", f"buffer.batch_size={batch}", "buffer.capacity=1024"]
    out = await run(CONFIG, f"{placement}-{batch}", overrides, steps)
    metrics, run_dir = out["metrics"], out["run_dir"]
    parts = step_parts(metrics)
    cfg = load_config(load_app(APP)[1], CONFIG, overrides)
    threads = (
        len(os.sched_getaffinity(0))
        if placement == "colocated"
        else cfg.trainer_resources.cpus_per_proc
    )
    fixed = fixed_shape_rate(threads, params)
    later = steady(metrics)
    tokens, positions = median(later, "train/tokens"), median(later, "train/positions")
    rates = {
        "trainer step": 6 * params * tokens / parts["trained"],
        "forward": 2 * params * tokens / parts["forward"],
        "backward": 4 * params * tokens / parts["backward"],
    }
    if parts["previous"]:
        previous = median(later, "train/previous_positions")
        rates["previous"] = 2 * params * previous / parts["previous"]
    row = f"{batch} sequences, {placement}"
    say(f"\n{row}: {parts['step']:.1f} s/step; {tokens:.0f} tokens, {positions:.0f} positions")
    for name in PARTS:
        say(f"  {name:<12} {parts[name]:7.2f} s  {parts[name] / parts['step']:6.1%}")
        result.figure(f"{row}: {name}", parts[name], "s")
    busy, score = generator_busy(run_dir, steps), median(later, "rollout/score_s")
    say(f"  overlapped: generators busy {busy:.2f} s, scoring {score:.2f} s (summed over groups)")
    for phase in ("prepare", "pause", "swap"):
        seconds = median(later, f"weights/generator_{phase}_s")
        say(f"  generator {phase}: {seconds:.3f} s")
        result.figure(f"{row}: generator {phase}", seconds, "s")
    result.figure(f"{row}: step", parts["step"], "s/step")
    result.figure(f"{row}: generators busy", busy, "s")
    result.ratio(f"{row}: positions / tokens (padding)", positions / tokens)
    say(
        f"  FLOP rates, as a fraction of the fixed-shape step ({fixed / 1e9:.1f} GFLOP/s, "
        f"{threads} threads):"
    )
    for name, rate in rates.items():
        say(f"    {name:<13} {rate / 1e9:6.1f} GFLOP/s = {rate / fixed:.2f}")
        target = ">= 0.9" if name == "trainer step" else ""
        result.ratio(f"{row}: {name} FLOP rate / fixed-shape step's", rate / fixed, target=target)
    return {"row": row, **parts}


def draw(rows: list[dict], path: Path) -> None:
    """One horizontal bar per run, its critical-path parts stacked in order."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(10, 0.7 * len(rows) + 1.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, r in enumerate(rows):
        left = 0.0
        for name, colour in PARTS.items():
            ax.barh(i, r[name], left=left, color=colour, edgecolor="white", height=0.6)
            left += r[name]
    ax.set_yticks(range(len(rows)), [r["row"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (median of steps 2..N-1)")
    handles = [Patch(color=c, label=n) for n, c in PARTS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=100)


async def main(args: argparse.Namespace) -> None:
    params = parameters(CONFIG)
    result = Result("step_profile")
    rows = [
        await profile(batch, placement, args.steps, params, result)
        for batch in args.sizes
        for placement in args.placements
    ]
    result.write()  # first: the drawing changes a tracked file, and the result records that
    draw(rows, FOLDER / "step_profile.png")


if __name__ == "__main__":
    library_output_to_log("step_profile")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--placements", nargs="+", default=["colocated", "split"])
    parser.add_argument("--steps", type=int, default=6, help="at least 3")
    asyncio.run(main(parser.parse_args()))
