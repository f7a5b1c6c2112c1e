"""Time to first step: `forge run` of the GRPO app against the one-process baseline's start-up,
taken apart per role.

Each repeat launches `forge run apps/grpo/main.py --config <config> steps=1` in a fresh run
folder and the one-process baseline (`bench/single_process.py`'s: `transformers` generate, then
a training step, in one process) for one step, alternating which goes first, each a process of
its own. Time to first step is from the launch to the first step's metrics row (forge) or to the
process's exit (the baseline, which exits as its step ends). forge's start-up is taken apart
from the run folder's startup.jsonl (forge.observability.startup: each process's phases,
wall-clock): the controller's imports and config, the data's opening, each role's process
spawn, boot (interpreter and imports) and setup (the generator's vLLM import, its engine's config
and engine-core process start; the trainer's process group and model build), the placement fit
(calibration, unless cached or placement is fixed), and the first step's generation, training
and weight publish (its timeline). The engine core's own parts (model init, weights load with
kernel packing, memory profile with KV cache and warm-up) are vLLM's log lines, at INFO for
these runs. Printed and recorded: the medians over repeats, forge / baseline time to first step
(target <= 2.0). Draws one bar per role, its phases where they fell, and the baseline's beneath:
bench/results/startup.png.

    python bench/startup.py [--configs configs/grpo/tiny_cpu.yaml ...] [--repeats 2] [k=v ...]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from library_log import library_output_to_log
from result import FOLDER, ROOT, Result
from scratch import scratch_folder

from forge.observability.console import say
from forge.observability.startup import read_phases
from forge.observability.timeline import read_timeline

TARGETS = {"tiny_cpu": "<= 10", "smollm2_cpu": "<= 20"}  # seconds to first step, issue 50
# vLLM's engine-core log lines that time its own start-up parts.
VLLM_PARTS = {
    "vLLM model init": r"Initializing model took ([\d.]+) s",
    "vLLM weights load": r"Loading weights took ([\d.]+) s",
    "vLLM profile, KV cache, warm-up": r"warmup model\) took ([\d.]+) s",
}
# The first step's intervals on the timeline, by lane kind and what.
FIRST_STEP = {"generate": "generate", "train": "train"}
PUBLISH = ("prepare", "pause", "swap")
# Phases that hold others of their lane: in the table, not drawn over what they hold.
ENCLOSING = ("spawn and setup", "spawn roles")


def forge_run(config: str, overrides: list[str], folder: Path) -> dict:
    """One `forge run ... steps=1`: its time to first step and each phase's seconds and place
    (from the launch)."""
    run_dir = folder / f"run-{time.time_ns()}"
    forge = Path(sys.executable).with_name("forge")  # the console script beside this python
    command = [str(forge), "run", "apps/grpo/main.py", "--config", config]
    command += ["steps=1", f"run_dir={run_dir}", *overrides]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "PYTHONPATH": str(ROOT)}
    launched = time.time()
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    # The first training row: a held-out eval of the starting weights writes a step-0 row.
    first = next(r["time"] for r in rows if r["step"] == 1 and "eval/version" not in r)
    spans = [
        (p["role"], p["what"], p["start"] - launched, p["end"] - launched)
        for p in read_phases(run_dir / "startup.jsonl")
    ]
    publish = []
    # Generation goes on past the first step's row; what it did after is not start-up.
    for s in (s for s in read_timeline(run_dir) if s["step"] == 1 and s["start"] < first):
        if s["what"] in FIRST_STEP:
            spans.append(("first step", FIRST_STEP[s["what"]], *_since(s, launched)))
        elif s["what"] in PUBLISH:
            publish.append(_since(s, launched))
    if publish:
        start, end = min(p[0] for p in publish), max(p[1] for p in publish)
        spans.append(("first step", "weight publish", start, end))
    log = (run_dir / "forge.log").read_text()
    engine = {}
    for name, pattern in VLLM_PARTS.items():
        if found := re.search(pattern, log):
            engine[name] = float(found.group(1))
    return {"first_step_s": first - launched, "spans": spans, "engine": engine}


def _since(span: dict, launched: float) -> tuple[float, float]:
    return span["start"] - launched, span["end"] - launched


def baseline_run(config: str, overrides: list[str], folder: Path) -> float:
    """The one-process baseline's seconds from its launch to its first step's end: its run of
    two steps (its summary needs a second) less the second."""
    out, log = folder / f"one-{time.time_ns()}.json", folder / "one-process.log"
    command = [sys.executable, str(ROOT / "bench" / "single_process.py"), "--run", "one process"]
    command += ["--out", str(out), "--log", str(log), "--config", config, "--steps", "2"]
    launched = time.time()
    subprocess.run([*command, *overrides], cwd=ROOT, check=True, capture_output=True)
    ended = time.time()
    first, second = (m["run/elapsed_s"] for m in json.loads(out.read_text())["metrics"])
    return ended - launched - (second - first)


def phase_seconds(run: dict) -> dict[str, float]:
    """Each role's phases' seconds by `role: what` (a role's processes' longest), and vLLM's."""
    seconds: dict[str, float] = {}
    for role, what, start, end in run["spans"]:
        key = f"{role}: {what}"
        seconds[key] = max(seconds.get(key, 0.0), end - start)
    engine = run["engine"]
    if engine and "Generator: engine core start" in seconds:
        rest = seconds["Generator: engine core start"] - sum(engine.values())
        seconds["Generator: engine core boot (fork, config)"] = rest
    return {**seconds, **{f"Generator: {k}": v for k, v in engine.items()}}


def draw(runs: dict[str, dict], baselines: dict[str, float], path: Path) -> None:
    """Per config, one bar per role, its phases where they fell after the launch; the
    baseline's time to first step as one bar beneath."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    whats = sorted({s[1] for run in runs.values() for s in run["spans"] if s[1] not in ENCLOSING})
    palette = matplotlib.colormaps["tab20"].colors + matplotlib.colormaps["tab20b"].colors
    colours = dict(zip(whats, palette, strict=False))
    lanes = [
        (f"{name}: {role}", [s for s in run["spans"] if s[0] == role and s[1] not in ENCLOSING])
        for name, run in runs.items()
        for role in dict.fromkeys(s[0] for s in run["spans"])
    ]
    lanes += [(f"{name}: one process", []) for name in runs]
    fig = Figure(figsize=(11, 0.45 * len(lanes) + 2.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, (lane, spans) in enumerate(lanes):
        for _, what, start, end in spans:
            ax.barh(i, end - start, left=start, color=colours[what], edgecolor="white", height=0.6)
        if lane.endswith(": one process"):
            name = lane.removesuffix(": one process")
            ax.barh(i, baselines[name], left=0, color="black", height=0.6)
        else:
            ax.axvline(runs[lane.split(": ")[0]]["first_step_s"], color="gray", lw=0.5)
    ax.set_yticks(range(len(lanes)), [lane for lane, _ in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds after launch (the median run's phases; black: one-process baseline)")
    handles = [Patch(color=c, label=w) for w, c in colours.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=100)


def main(args: argparse.Namespace) -> None:
    result = Result("startup")
    folder = scratch_folder("startup")
    medians, baselines = {}, {}
    for config in args.configs:
        name = Path(config).stem
        forge, one = [], []
        for r in range(args.repeats):
            order = ["forge", "one"] if r % 2 else ["one", "forge"]
            for side in order:
                if side == "forge":
                    forge.append(forge_run(config, args.overrides, folder))
                else:
                    one.append(baseline_run(config, args.overrides, folder))
            say(f"  {name} repeat {r + 1}: forge {forge[-1]['first_step_s']:.1f} s, one process "
                f"{one[-1]:.1f} s to first step")  # fmt: skip
        firsts = [f["first_step_s"] for f in forge]
        forge_s, one_s = statistics.median(firsts), statistics.median(one)
        medians[name] = sorted(forge, key=lambda f: f["first_step_s"])[len(forge) // 2]
        baselines[name] = one_s
        phases = [phase_seconds(f) for f in forge]
        say(f"{name}: time to first step, median of {len(forge)}")
        for key in sorted({k for p in phases for k in p}, key=lambda k: (k.split(":")[0], k)):
            seconds = statistics.median(p.get(key, 0.0) for p in phases)
            say(f"  {key:<56}{seconds:7.2f} s")
            result.figure(f"{name}: {key}", seconds, "s")
        say(f"  forge {forge_s:.1f} s (target {TARGETS.get(name, '-')}), one process {one_s:.1f} s")
        say(f"  forge / one process: {forge_s / one_s:.2f} (target <= 2.0)\n")
        result.figure(f"{name}: forge time to first step", forge_s, "s", target=TARGETS.get(name))
        result.figure(f"{name}: one process time to first step", one_s, "s")
        result.ratio(
            f"{name}: forge / one process time to first step",
            forge_s / one_s,
            target="<= 2.0",
            headline=name == "tiny_cpu",
        )
    result.write()  # first: the drawing changes a tracked file, and the result records that
    draw(medians, baselines, FOLDER / "startup.png")


if __name__ == "__main__":
    library_output_to_log("startup")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["configs/grpo/tiny_cpu.yaml"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (both sides)")
    main(parser.parse_args())
