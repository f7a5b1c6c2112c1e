"""Async GRPO against sync GRPO, same placement, same run: how much of the ideal overlap we get.

Runs the GRPO app twice in this process: `mode: sync` (generate a batch, then train on it),
then `mode: async`. From the sync run it takes the generation time per batch (Tgen) and the
training time per step, weight sync included (Ttrain); the ideal async speedup is
(Tgen + Ttrain) / max(Tgen, Ttrain). Seconds per step exclude the first step (start-up).
The trainer's exact mismatch KL (an extra forward pass, needed only for stale batches, so only
in async mode) is off unless an override turns it on: it is a measurement, not training.

    python bench/async_speedup.py [--config configs/grpo/smollm2_cpu.yaml] [--steps 6] [k=v ...]
"""

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from forge.cli import load_app
from forge.config import load_config

APP = Path(__file__).parents[1] / "apps" / "grpo" / "main.py"


def per_step(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def seconds_per_step(steps: list[dict[str, float]]) -> float:
    elapsed = [s["run/elapsed_s"] for s in steps]
    return statistics.median(b - a for a, b in zip(elapsed, elapsed[1:], strict=False))


async def run(config: str, mode: str, steps: int, overrides: list[str]) -> list[dict]:
    app_main, schema = load_app(APP)
    run_dir = Path(tempfile.mkdtemp(prefix=f"forge-bench-{mode}-"))
    cfg = load_config(
        schema, config, [*overrides, f"mode={mode}", f"steps={steps}", f"run_dir={run_dir}"]
    )
    print(f"{mode} run: {steps} steps -> {run_dir}", flush=True)
    await app_main(cfg)
    return per_step(run_dir)


async def main(args: argparse.Namespace) -> None:
    # One placement for both modes (auto could pick another for each): the config's split.
    overrides = ["placement=split", "trainer.exact_mismatch=false", *args.overrides]
    sync = await run(args.config, "sync", args.steps, overrides)
    asynchronous = await run(args.config, "async", args.steps, overrides)
    t_gen = statistics.median(s["rollout/batch_s"] for s in sync[1:])
    t_train = statistics.median(s["train/step_s"] for s in sync[1:])
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    sync_s, async_s = seconds_per_step(sync), seconds_per_step(asynchronous)
    speedup = sync_s / async_s
    print(f"sync:  {sync_s:.2f} s/step (generation {t_gen:.2f} s + training {t_train:.2f} s)")
    print(f"async: {async_s:.2f} s/step")
    print(f"ideal speedup (Tgen + Ttrain) / max(Tgen, Ttrain): {ideal:.3f}")
    print(
        f"async speedup: {speedup:.3f} = {speedup / ideal:.3f} of the ideal "
        f"({(speedup - 1) / max(ideal - 1, 1e-9):.2f} of the possible gain); target >= 0.8"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo/smollm2_cpu.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    asyncio.run(main(parser.parse_args()))
