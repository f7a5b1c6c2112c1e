"""A PNG of a run's key metrics over steps, drawn from its metrics.jsonl."""

from collections.abc import Sequence
from pathlib import Path

from forge.observability.jsonl import read_jsonl

# Whether a GRPO run learns, stays near on-policy, and how fast it goes.
PLOT_KEYS = ("rollout/reward", "train/mismatch_kl", "generator/tokens_per_s")
MARK_COLOUR = "tab:red"  # the lines marking live changes, here and on the timeline


def plot_series(run_dir: str | Path, keys: Sequence[str]) -> dict[str, tuple[list, list]]:
    """Each key's (steps, values) in metrics.jsonl, in step order, for the keys that were logged.

    An eval's row stands under the step whose weights it scored (the starting weights': step
    0), written when the eval ended, after the rows of the steps trained meanwhile.
    """
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    rows.sort(key=lambda row: row["step"])
    series = {}
    for key in keys:
        if logged := [row for row in rows if key in row]:
            series[key] = ([row["step"] for row in logged], [row[key] for row in logged])
    return series


def plot_run(
    run_dir: str | Path, keys: Sequence[str] = PLOT_KEYS, marks: Sequence[int] = ()
) -> Path:
    """Draws one subplot per key over steps into run_dir/metrics.png, with a dashed line at
    each step of `marks` (the first under a setting changed live), and returns its path.

    Keys that no step logged are left out; if none was logged, raises ValueError.
    """
    # Figure and the Agg canvas directly, not pyplot: no global backend switch, no GUI, and
    # safe to call from a process that also plots elsewhere.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    present = plot_series(run_dir, keys)
    if not present:
        raise ValueError(f"none of {list(keys)} is in {run_dir}'s metrics.jsonl")

    fig = Figure(figsize=(7, 2.4 * len(present)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, (steps, values)) in zip(axes, present.items(), strict=True):
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        for step in marks:
            ax.axvline(step, color=MARK_COLOUR, linestyle="--", alpha=0.6)
        ax.set_title(key, fontsize="medium")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    path = run_dir / "metrics.png"
    fig.savefig(path, dpi=100)
    return path
