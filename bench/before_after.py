"""Before and after: seconds per step of `make grpo`, the batch-64 colocated step and the split,
run from an earlier commit and from this one, side by side in one run.

The earlier commit is checked out in a git worktree of its own (removed at the end). Every run
is `python -m forge run` in a process of its own, from its tree's code with this environment's
packages, so neither side's driver inherits the other's heap or threads; the runs alternate,
before then after, then after then before, `--repeats` times, so that a drifting machine falls
on both sides and neither always runs second. Seconds
per step are the median over steps 2..N-1 of each run's elapsed time (the first step also
starts the pipeline, the last waits for the final update). Prints, per case, each side's
runs and after / before (below 1: faster now). Each run's console output goes to a log
beside the bench's library log.

    python bench/before_after.py [--before COMMIT] [--steps 6] [--repeats 2] [--cases NAME ...]
"""

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from async_speedup import per_step, steady_seconds_per_step
from library_log import library_output_to_log
from result import Result
from scratch import scratch_folder

from forge.observability.console import say

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/grpo/smollm2_cpu.yaml"
# The commit before issue 48's changes (the run as parts, batches waited for).
BEFORE = "ae7de92"
CASES = {  # name: overrides of `make grpo`'s command line
    "make grpo": [],
    "64 sequences, colocated": [
        "placement=colocated",
        "buffer.batch_size=64",
        "buffer.capacity=1024",
    ],
    "16 sequences, split": ["placement=split"],
}
QUIET = ["eval.interval=0", "export_hf=false"]


def no_checkpoints(tree: Path) -> str:
    """The override that turns checkpoints off, in `tree`'s spelling: before issue 48 a config
    named the folder (`checkpoint: {folder: ...}`), and null turned them off."""
    if "checkpoint: {folder:" in (tree / CONFIG).read_text():
        return "trainer.checkpoint.folder=null"
    return "trainer.checkpoint.enabled=false"


def run(tree: Path, overrides: list[str], steps: int, log: Path) -> float:
    """One `forge run` of the GRPO app from `tree`'s code; its steady seconds per step."""
    run_dir = scratch_folder("before-after")
    args = [*QUIET, no_checkpoints(tree), *overrides, f"steps={steps}", f"run_dir={run_dir}"]
    command = [sys.executable, "-m", "forge", "run", "apps/grpo/main.py", "--config", CONFIG]
    env = {**os.environ, "PYTHONPATH": str(tree)}  # ahead of the editable install's finder
    with log.open("w") as out:
        done = subprocess.run([*command, *args], cwd=tree, env=env, stdout=out, stderr=out)
    if done.returncode:
        raise RuntimeError(f"forge run in {tree} exited {done.returncode}; see {log}")
    return steady_seconds_per_step(per_step(run_dir))


def worktree(commit: str) -> Path:
    """`commit` checked out in a temporary worktree of this repository."""
    path = scratch_folder("before-tree") / "forge"
    git = ["git", "-C", str(ROOT), "worktree"]
    subprocess.run([*git, "add", "--detach", str(path), commit], check=True, capture_output=True)
    return path


def main(args: argparse.Namespace, logs: Path) -> None:
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.before],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    trees = {"before": worktree(sha), "after": ROOT}
    result = Result("before_after")
    try:
        for case in args.cases:
            times = measure(case, CASES[case], trees, args, logs)
            report(case, times, sha, result)
    finally:
        git = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees["before"])]
        subprocess.run(git, check=True)
    result.write()


def measure(
    case: str, overrides: list[str], trees: dict[str, Path], args: argparse.Namespace, logs: Path
) -> dict[str, list[float]]:
    """Each side's steady seconds per step, `args.repeats` runs each, alternating."""
    times: dict[str, list[float]] = {side: [] for side in trees}
    slug = case.replace(" ", "_").replace(",", "")
    for repeat in range(args.repeats):
        order = list(trees.items())
        for side, tree in order if repeat % 2 == 0 else reversed(order):
            log = logs / f"{slug}-{side}-{repeat}.log"
            times[side].append(run(tree, overrides, args.steps, log))
            say(f"{case}, {side} ({repeat + 1}/{args.repeats}): {times[side][-1]:.2f} s/step")
    return times


def report(case: str, times: dict[str, list[float]], sha: str, result: Result) -> None:
    for side, values in times.items():
        name = f"{case}: {side}" + (f" ({sha})" if side == "before" else "")
        for i, seconds in enumerate(values):
            result.figure(f"{name}, run {i + 1}", seconds, "s/step")
        result.figure(f"{name}, median", statistics.median(values), "s/step")
    ratio = statistics.median(times["after"]) / statistics.median(times["before"])
    say(f"{case}: after / before = {ratio:.3f}")
    result.ratio(f"{case}: after / before", ratio)


if __name__ == "__main__":
    library_log = library_output_to_log("before_after")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="the earlier commit")
    parser.add_argument("--steps", type=int, default=6, help="at least 3")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    main(parser.parse_args(), library_log.parent)
