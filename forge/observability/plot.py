"""A PNG of a run's key metrics over steps, drawn from its metrics.jsonl."""

import json
from collections.abc import Sequence
from pathlib import Path

# Whether a GRPO run learns, stays near on-policy, and how fast it goes.
PLOT_KEYS = ("rollout/reward", "train/mismatch_kl", "generator/tokens_per_s")


def plot_run(run_dir: str | Path, keys: Sequence[str] = PLOT_KEYS) -> Path:
    """Draws one subplot per key over steps into run_dir/metrics.png and returns its path.

    Keys that no step logged are left out; if none was logged, raises ValueError.
    """
    # Figure and the Agg canvas directly, not pyplot: no global backend switch, no GUI, and
    # safe to call from a process that also plots elsewhere.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    series: dict[str, tuple[list[int], list[float]]] = {key: ([], []) for key in keys}
    with (run_dir / "metrics.jsonl").open() as f:
        for line in f:
            row = json.loads(line)
            for key, (steps, values) in series.items():
                if key in row:
                    steps.append(row["step"])
                    values.append(row[key])
    present = {key: xy for key, xy in series.items() if xy[0]}
    if not present:
        raise ValueError(f"none of {list(keys)} is in {run_dir / 'metrics.jsonl'}")

    fig = Figure(figsize=(7, 2.4 * len(present)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, (steps, values)) in zip(axes, present.items(), strict=True):
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        ax.set_title(key, fontsize="medium")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    path = run_dir / "metrics.png"
    fig.savefig(path, dpi=100)
    return path
