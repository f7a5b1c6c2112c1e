"""A run's timeline: when the trainer trained, and when each generator generated rollouts,
answered an eval, built a weight version, paused and swapped it in, as intervals on the actors'
own clocks, in run_dir/timeline.jsonl and a PNG.

Each line is one interval: `step`, `lane` (e.g. "trainer", "generator 0"), `what` ("train",
"generate", "eval", "prepare", "pause", "swap"), `start` and `end` (Unix seconds, from the
process that did it). A generator generates, evaluates and prepares a version at once: eval and
prepare are drawn as thinner bars over generation, and pauses and swaps over all.
"""

from collections.abc import Sequence
from pathlib import Path

from forge.observability.jsonl import read_jsonl
from forge.observability.plot import MARK_COLOUR

# In drawing order, with each bar's height: later ones are drawn over earlier ones.
COLOURS = {
    "train": "tab:blue",
    "generate": "tab:green",
    "eval": "tab:purple",
    "prepare": "tab:olive",
    "pause": "tab:orange",
    "swap": "tab:red",
}
HEIGHTS = {"eval": 0.3, "prepare": 0.3}


def read_timeline(run_dir: str | Path) -> list[dict]:
    """The intervals of run_dir/timeline.jsonl, in the order they were written (of a running
    run: less a last line still being written)."""
    return read_jsonl(Path(run_dir) / "timeline.jsonl")


def plot_timeline(run_dir: str | Path, marks: Sequence[float] = ()) -> Path | None:
    """Draws the intervals as bars, one row per lane, into run_dir/timeline.png, with a
    dashed line at each time of `marks` (Unix seconds: settings changed live); returns its
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
    order = list(COLOURS)
    for s in sorted(spans, key=lambda s: order.index(s["what"]) if s["what"] in order else -1):
        row = lanes.index(s["lane"])
        colour = COLOURS.get(s["what"], "tab:gray")
        height = HEIGHTS.get(s["what"], 0.6)
        ax.barh(row, s["end"] - s["start"], left=s["start"] - origin, color=colour, height=height)
    for at in marks:
        ax.axvline(at - origin, color=MARK_COLOUR, linestyle="--", alpha=0.6)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first interval")
    ax.legend(handles=[Patch(color=c, label=w) for w, c in COLOURS.items()], loc="upper right")
    ax.grid(axis="x", alpha=0.3)
    path = Path(run_dir) / "timeline.png"
    fig.savefig(path, dpi=100)
    return path
