"""What a checkpoint costs the training loop: blocking DCP save vs background save, per step.

A TitanTrainer (SmolLM2-135M, fp32, Adam state: ~1.6 GB of checkpoint) takes optimizer steps
and saves after each, in one run: the step time, the blocking save (`dcp.save`), the background
save's blocking part (staging a copy in memory) and its full time until `latest` moves. The
simplest alternative, a plain `torch.save` of the same bytes to the same disk, sets the write
limit; ratios to it and to the step time are printed.

    python bench/checkpoint.py [--saves 3] [--folder /tmp/forge-bench-checkpoint]
"""

import argparse
import asyncio
import random
import shutil
import statistics
import time
from pathlib import Path

import torch
from library_log import library_output_to_log
from result import Result

from forge.actors.trainer import TitanTrainer, TrainerConfig
from forge.actors.trainer.checkpoint_folder import CheckpointConfig
from forge.controller import shutdown
from forge.data import Completion, Episode
from forge.models import smollm2
from forge.observability.console import say


def batch(seed: int, n: int = 8) -> list[Episode]:
    """Random token sequences, each its own group: enough for the optimizer to have state."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(49152) for _ in range(32)]
        tokens = [rng.randrange(49152) for _ in range(32)]
        completion = Completion(prompt, tokens, "", [-10.8] * 32, [0] * 32, "")
        out.append(Episode(f"{seed}-{i}", f"{seed}-{i}", completion, advantage=rng.uniform(-1, 1)))
    return out


def plain_write_s(nbytes: int, folder: Path) -> float:
    """Seconds for `torch.save` of `nbytes` of tensors to `folder` (what a user would write)."""
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    start = time.perf_counter()
    torch.save(tensor, folder / "plain.pt")
    seconds = time.perf_counter() - start
    (folder / "plain.pt").unlink()
    return seconds


async def measure(saves: int, folder: Path) -> dict[str, float]:
    cfg = TrainerConfig(model=str(smollm2()), checkpoint=CheckpointConfig(folder=str(folder)))
    trainer = await TitanTrainer.as_actor(cfg)
    times: dict[str, list[float]] = {"step": [], "blocking": [], "staging": [], "background": []}
    for i in range(saves):
        start = time.perf_counter()
        await trainer.train_step.call_one([batch(2 * i)])
        times["step"].append(time.perf_counter() - start)
        times["blocking"].append(await trainer.save_checkpoint.call_one(background=False))
        await trainer.train_step.call_one([batch(2 * i + 1)])
        start = time.perf_counter()
        times["staging"].append(await trainer.save_checkpoint.call_one(background=True))
        await trainer.wait_checkpoint.call_one()
        times["background"].append(time.perf_counter() - start)
    nbytes = sum(f.stat().st_size for f in folder.rglob("*.distcp")) // min(saves * 2, 2)
    return {name: statistics.median(values) for name, values in times.items()} | {
        "bytes": nbytes,
        "plain": plain_write_s(nbytes, folder),
    }


LABELS = {
    "blocking": "blocking save (dcp.save)",
    "staging": "background save, the loop's pause (staging)",
    "background": "background save, until latest moves",
}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/forge-bench-checkpoint"))
    args = parser.parse_args()
    shutil.rmtree(args.folder, ignore_errors=True)
    try:
        r = await measure(args.saves, args.folder)
    finally:
        await shutdown()
        shutil.rmtree(args.folder, ignore_errors=True)
    say(f"checkpoint of SmolLM2-135M + Adam: {r['bytes'] / 1e9:.2f} GB; step {r['step']:.2f}s")
    say(f"plain torch.save of the same bytes: {r['plain']:.2f}s (the write limit)")
    for name in ("blocking", "staging", "background"):
        say(
            f"{name:>10}: {r[name]:6.2f}s = {r[name] / r['plain']:5.2f} x plain write, "
            f"{r[name] / r['step']:5.2f} x a training step"
        )
    say(f"the loop pays {r['staging'] / r['blocking']:.2f} x of a blocking save per checkpoint")
    result = (
        Result("checkpoint")
        .figure("checkpoint size (SmolLM2-135M + Adam)", r["bytes"] / 1e9, "GB")
        .figure("training step", r["step"], "s")
        .figure("plain torch.save of the same bytes", r["plain"], "s")
    )
    for name, label in LABELS.items():
        result.figure(label, r[name], "s")
        result.ratio(f"{label} / plain torch.save", r[name] / r["plain"])
        result.ratio(f"{label} / training step", r[name] / r["step"])
    result.ratio(
        "loop's pause per checkpoint, background / blocking save",
        r["staging"] / r["blocking"],
        headline=True,
    ).write()


if __name__ == "__main__":
    library_output_to_log("checkpoint")
    asyncio.run(main())
