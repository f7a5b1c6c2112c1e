"""A run's timeline: when the trainer trained and when each generator paused and swapped
weights, as intervals on the actors' own clocks, in run_dir/timeline.jsonl and a PNG.

Each line is one interval: `step`, `lane` (e.g. "trainer", "generator 0"), `what` ("train",
"pause", "swap"), `start` and `end` (Unix seconds, from the process that did it).
"""

import json
from pathlib import Path

COLOURS = {"train": "tab:blue", "pause": "tab:orange", "swap": "tab:red"}


def read_timeline(run_dir: str | Path) -> list[dict]:
    """The intervals of run_dir/timeline.jsonl, in the order they were written."""
    path = Path(run_dir) / "timeline.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plot_timeline(run_dir: str | Path) -> Path | None:
    """Draws the intervals as bars, one row per lane, into run_dir/timeline.png; returns its
    path, or None if the run has no timeline."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    spans = read_timeline(run_dir)
    if not spans:
        return None
    origin = min(s["start"] for s in spans)
    lanes = sorted({s["lane"] for s in spans}, key=lambda lane: (lane != "trainer", lane))
    fig = Figure(figsize=(9, 0.6 * len(lanes) + 1.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for s in spans:
        row = lanes.index(s["lane"])
        colour = COLOURS.get(s["what"], "tab:gray")
        ax.barh(row, s["end"] - s["start"], left=s["start"] - origin, color=colour, height=0.6)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first interval")
    ax.legend(handles=[Patch(color=c, label=w) for w, c in COLOURS.items()], loc="upper right")
    ax.grid(axis="x", alpha=0.3)
    path = Path(run_dir) / "timeline.png"
    fig.savefig(path, dpi=100)
    return path
