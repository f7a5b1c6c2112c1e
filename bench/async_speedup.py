"""Async GRPO against sync GRPO, same placement: how much of the ideal overlap we get.

Runs the GRPO app in this process, `mode: sync` (generate a batch, then train on it) and
`mode: async`, `--repeats` times, alternating which mode goes first (sync, async; async,
sync; ...) so that a drift of the machine's speed does not favour one. From each sync run it
takes the generation time per batch (Tgen) and the training time per step, weight sync included
(Ttrain); the ideal async speedup is (Tgen + Ttrain) / max(Tgen, Ttrain). Seconds per step
exclude the first step (start-up). Everything runs at its default, the trainer's exact mismatch
measurement included (a sample of each stale batch; see trainer.exact_mismatch_sample).
Printed: each repeat, then the median and the spread (min..max) of each figure.

    python bench/async_speedup.py [--config configs/grpo/smollm2_cpu.yaml] [--steps 6]
        [--repeats 3] [k=v ...]
"""

import argparse
import asyncio
import json
import statistics
from pathlib import Path

from library_log import library_output_to_log
from result import Result
from scratch import scratch_folder

from forge.cli import load_app
from forge.config import load_config
from forge.observability.console import say

APP = Path(__file__).parents[1] / "apps" / "grpo" / "main.py"


def per_step(run_dir: Path) -> list[dict[str, float]]:
    """metrics.jsonl's steps' rows, not its evals' (marked by eval/version)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "eval/version" not in row]


def seconds_per_step(steps: list[dict[str, float]]) -> float:
    elapsed = [s["run/elapsed_s"] for s in steps]
    return statistics.median(b - a for a, b in zip(elapsed, elapsed[1:], strict=False))


def steady_seconds_per_step(steps: list[dict[str, float]]) -> float:
    """Median seconds per step over steps 2..N-1: the first also starts the pipeline, the last
    waits for the final update."""
    elapsed = [s["run/elapsed_s"] for s in steps]
    return statistics.median(b - a for a, b in zip(elapsed[:-2], elapsed[1:-1], strict=True))


async def run(config: str, mode: str, steps: int, overrides: list[str]) -> list[dict]:
    app_main, schema = load_app(APP)
    run_dir = scratch_folder(mode)
    cfg = load_config(
        schema, config, [*overrides, f"mode={mode}", f"steps={steps}", f"run_dir={run_dir}"]
    )
    say(f"{mode} run: {steps} steps -> {run_dir}")
    await app_main(cfg)
    return per_step(run_dir)


def figures(sync: list[dict], asynchronous: list[dict]) -> dict[str, float]:
    """One repeat's figures from a sync run's and an async run's per-step metrics."""
    t_gen = statistics.median(s["rollout/batch_s"] for s in sync[1:])
    t_train = statistics.median(s["train/step_s"] for s in sync[1:])
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    sync_s, async_s = seconds_per_step(sync), seconds_per_step(asynchronous)
    speedup = sync_s / async_s
    return {
        "sync_s": sync_s,
        "async_s": async_s,
        "t_gen": t_gen,
        "t_train": t_train,
        "ideal": ideal,
        "speedup": speedup,
        "gain": (speedup - 1) / max(ideal - 1, 1e-9),
        "idle": statistics.median(s["train/idle_fraction"] for s in asynchronous[1:]),
    }


def line(name: str, f: dict[str, float]) -> str:
    return (
        f"{name:<10} sync {f['sync_s']:6.2f} s/step (gen {f['t_gen']:5.2f} + train "
        f"{f['t_train']:5.2f})  async {f['async_s']:6.2f} s/step  speedup {f['speedup']:.3f} of "
        f"ideal {f['ideal']:.3f} = {f['gain']:5.2f} of the possible gain  async trainer idle "
        f"{f['idle']:.3f}"
    )


async def main(args: argparse.Namespace) -> None:
    # One placement for both modes (auto could pick another for each): the config's split.
    overrides = ["placement=split", *args.overrides]
    repeats = []
    for i in range(args.repeats):
        order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
        runs = {mode: await run(args.config, mode, args.steps, overrides) for mode in order}
        repeats.append(figures(runs["sync"], runs["async"]))
        say(line(f"repeat {i + 1}", repeats[-1]))
    say("")
    for i, f in enumerate(repeats):
        say(line(f"repeat {i + 1}", f))
    median = {k: statistics.median(f[k] for f in repeats) for k in repeats[0]}
    say(line("median", median))
    for key, label in [("async_s", "async s/step"), ("sync_s", "sync s/step"), ("gain", "gain")]:
        values = [f[key] for f in repeats]
        say(f"spread of {label}: {min(values):.3f} .. {max(values):.3f}")
    say(
        f"async / sync s/step (median): {median['async_s'] / median['sync_s']:.3f} (target <= 1); "
        f"possible gain {median['gain']:.2f} (target >= 0.8); async trainer idle "
        f"{median['idle']:.3f} (target < 0.05)"
    )
    (
        Result("async_speedup")
        .figure("sync, median", median["sync_s"], "s/step")
        .figure("async, median", median["async_s"], "s/step")
        .figure("sync: generation per batch (Tgen)", median["t_gen"], "s")
        .figure("sync: training per step, weight sync included (Ttrain)", median["t_train"], "s")
        .ratio(
            "async / sync s/step",
            median["async_s"] / median["sync_s"],
            target="<= 1",
            headline=True,
        )
        .ratio("ideal speedup (Tgen + Ttrain) / max(Tgen, Ttrain)", median["ideal"])
        .ratio("speedup sync / async s/step", median["speedup"])
        .ratio("share of the possible gain", median["gain"], target=">= 0.8")
        .ratio("async trainer idle fraction", median["idle"], target="< 0.05")
        .write()
    )


if __name__ == "__main__":
    library_output_to_log("async_speedup")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo/smollm2_cpu.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    asyncio.run(main(parser.parse_args()))
