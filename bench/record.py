"""What the batch record costs a run, and what a replay costs: `make grpo`'s config at 16 and 64
sequences a step.

For each batch size, one run of a few steps with every step recorded: the record's share of the
step (`train/digest_s`, hashing the parameters, plus `record/write_s`, writing the gzip'd JSON;
goal <= 2%) and its bytes per step, beside the simplest alternative a user would write, a
`torch.save` of the same episodes (timed and sized here, on the last recorded batch). Then
`forge replay --step N` of the last step, from the newest checkpoint it can start from (with
`--interval 2`, two steps back): its latency against the run's own s/step.

    python bench/record.py [--steps 4] [--interval 2] [--batch-sizes 16 64]
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from result import ROOT, Result

from forge.loop.record.batches import BatchRecord
from forge.observability.console import say

CONFIG = "configs/grpo/smollm2_cpu.yaml"


def run(run_dir: Path, batch_size: int, steps: int, interval: int) -> list[dict]:
    """`make grpo`'s config at `batch_size` sequences a step; its metrics, step by step."""
    overrides = [
        f"run_dir={run_dir}",
        f"steps={steps}",
        f"buffer.batch_size={batch_size}",
        "record.batches=all",
        f"trainer.checkpoint.interval={interval}",
        "trainer.checkpoint.keep=3",
        "eval.interval=0",
        "export_hf=false",
    ]
    cmd = [sys.executable, "-m", "forge", "run", "apps/grpo/main.py", "--config", CONFIG]
    subprocess.run([*cmd, *overrides], cwd=ROOT, check=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def plain_save(record: BatchRecord, step: int, folder: Path) -> tuple[float, int]:
    """Seconds and bytes of `torch.save` of a recorded step's episodes."""
    episodes = record.read(step).batches
    path = folder / "plain.pt"
    start = time.perf_counter()
    torch.save(episodes, path)
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    path.unlink()
    return seconds, size


def replay(run_dir: Path, step: int) -> tuple[float, int]:
    """Wall seconds of `forge replay RUN --step step` (which must match the record), and the
    steps it trained."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "forge", "replay", str(run_dir), "--step", str(step)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    print(done.stdout, done.stderr, end="")
    if done.returncode:
        raise SystemExit(f"forge replay exited {done.returncode}: the replay must match the run")
    first, last = map(int, re.search(r"steps (\d+)\.\.(\d+)", done.stdout).groups())
    return seconds, last - first + 1


def measure(batch_size: int, steps: int, interval: int, folder: Path) -> dict[str, float]:
    run_dir = folder / f"grpo-{batch_size}"
    logged = run(run_dir, batch_size, steps, interval)[1:]  # step 1 warms up
    record = BatchRecord(run_dir)
    cost = [m["train/digest_s"] + m["record/write_s"] for m in logged]
    step_s = [m["train/step_s"] for m in logged]
    plain_s, plain_bytes = plain_save(record, steps, folder)
    replay_s, replayed = replay(run_dir, steps)
    return {
        "step_s": statistics.median(step_s),
        "record_s": statistics.median(cost),
        "share": statistics.median(c / s for c, s in zip(cost, step_s, strict=True)),
        "digest_s": statistics.median(m["train/digest_s"] for m in logged),
        "write_s": statistics.median(m["record/write_s"] for m in logged),
        "bytes": statistics.median(m["record/bytes"] for m in logged),
        "plain_s": plain_s,
        "plain_bytes": plain_bytes,
        "replay_s": replay_s,
        "replayed": replayed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    result = Result("record")
    with tempfile.TemporaryDirectory(prefix="forge-bench-record-") as folder:
        for size in args.batch_sizes:
            r = measure(size, args.steps, args.interval, Path(folder))
            report(result, size, r)
    result.write()


def report(result: Result, size: int, r: dict[str, float]) -> None:
    say(
        f"{size} sequences: step {r['step_s']:.1f}s, record {r['record_s']:.3f}s = "
        f"{100 * r['share']:.2f}% of it (digest {r['digest_s']:.3f}s, write {r['write_s']:.3f}s), "
        f"{r['bytes'] / 1e3:.0f} kB; torch.save of the episodes {r['plain_s']:.3f}s, "
        f"{r['plain_bytes'] / 1e3:.0f} kB"
    )
    say(
        f"{size} sequences: forge replay --step N {r['replay_s']:.0f}s, "
        f"{r['replay_s'] / r['step_s']:.1f} x the run's s/step ({r['replayed']} steps trained "
        f"from a checkpoint)"
    )
    label = f"{size} sequences"
    result.figure(f"{label}: step", r["step_s"], "s")
    result.figure(f"{label}: record (digest + write) per step", r["record_s"], "s")
    result.ratio(f"{label}: record / step", r["share"], target="<= 0.02", headline=size == 64)
    result.figure(f"{label}: record bytes per step", r["bytes"] / 1e3, "kB")
    result.ratio(f"{label}: record bytes / torch.save bytes", r["bytes"] / r["plain_bytes"])
    result.ratio(f"{label}: record write / torch.save", r["write_s"] / r["plain_s"])
    result.figure(f"{label}: forge replay --step N", r["replay_s"], "s")
    result.ratio(f"{label}: forge replay --step N / run's s/step", r["replay_s"] / r["step_s"])


if __name__ == "__main__":
    main()
