"""Where each step's reduced metrics go: console, metrics.jsonl, TensorBoard, W&B.

`build_backends(MetricsConfig(...), run_dir)` makes the configured set; metrics.jsonl is always
written, since `plot_run` and any later analysis read it. TensorBoard and W&B are imported only
when enabled.
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, TextIO

from tqdm import tqdm

from forge.config import at_least
from forge.observability.console import console
from forge.observability.progress import ProgressBar, short_names

# A handful of numbers worth a glance every step, and the held-out reward on each eval's line
# (last, so a progress bar's two are always the same); the rest go to the files only.
CONSOLE_KEYS = (
    "rollout/reward",
    "train/loss",
    "train/mismatch_kl",
    "generator/tokens_per_s",
    "eval/reward",
)


class Backend(Protocol):
    """Receives each step's metrics, reduced to one float per key, and each eval's."""

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None: ...

    def log_eval(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        """One eval's `eval/` metrics, of the weights trained at `step` (0: the starting ones).
        It arrives when the eval ends, after later steps' rows (evals run in the background)."""
        ...

    def close(self) -> None: ...


@dataclass
class MetricsConfig:
    """Which backends a run logs to; metrics.jsonl is always on.

    Args:
        console: one line per step with `console_keys` (those present), and one per eval
            with the `eval/` ones.
        console_keys: the keys the console line shows.
        progress_total: steps in the run; when set, a progress bar shows step/total and the
            first two of `console_keys` present.
        tensorboard: event files under run_dir/tb.
        wandb: a W&B run under run_dir/wandb.
        wandb_project: the W&B project.
        wandb_mode: "offline" (default: nothing leaves the machine; `wandb sync` uploads later)
            or "online".
    """

    console: bool = True
    # A list, not a tuple: MetricsConfig is also a section of yaml configs (forge.config).
    console_keys: list[str] = field(default_factory=lambda: list(CONSOLE_KEYS))
    progress_total: int | None = None
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "forge"
    wandb_mode: Literal["offline", "online"] = "offline"

    def __post_init__(self) -> None:
        at_least(self, 1, "progress_total")


def build_backends(cfg: MetricsConfig, run_dir: str | Path) -> list[Backend]:
    """The backends `cfg` selects, jsonl first."""
    run_dir = Path(run_dir)
    backends: list[Backend] = [JsonlBackend(run_dir / "metrics.jsonl")]
    if cfg.progress_total is not None:
        # On a terminal only: in a pipe or a SLURM log the step lines say the same.
        bar = ProgressBar(cfg.progress_total, cfg.console_keys, file=console(), disable=None)
        backends.append(bar)
    if cfg.console:
        backends.append(ConsoleBackend(cfg.console_keys))
    if cfg.tensorboard:
        backends.append(TensorBoardBackend(run_dir / "tb"))
    if cfg.wandb:
        backends.append(
            WandbBackend(run_dir, project=cfg.wandb_project, mode=cfg.wandb_mode, name=run_dir.name)
        )
    return backends


class ConsoleBackend:
    """One compact line per step: `step 12 | reward 0.531 | loss 0.0123 | ...`, and one per
    eval: `eval of step 10 | reward 0.25 | loss 1.94`.

    Each key shows under its `short_names` name (an eval's without `eval/`), with four
    significant digits. Lines go through `tqdm.write`, so they print above a progress bar
    instead of breaking it.
    """

    def __init__(self, keys: Sequence[str] = CONSOLE_KEYS, file: TextIO | None = None) -> None:
        self.keys = tuple(keys)
        self.names = short_names(self.keys)
        self.file = file

    def format(self, step: int, metrics: Mapping[str, float]) -> str:
        """The line for one step (without a newline)."""
        parts = [f"step {step}"]
        parts += [f"{self.names[key]} {metrics[key]:.4g}" for key in self.keys if key in metrics]
        return " | ".join(parts)

    def format_eval(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """The line for one eval (without a newline); None if it has none of the keys."""
        keys = [key for key in self.keys if key in metrics]
        shown = [f"{key.removeprefix('eval/')} {metrics[key]:.4g}" for key in keys]
        return " | ".join([f"eval of step {step}", *shown]) if shown else None

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        tqdm.write(self.format(step, metrics), file=self.file or console())

    def log_eval(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        if (line := self.format_eval(step, metrics)) is not None:
            tqdm.write(line, file=self.file or console())

    def close(self) -> None:
        pass


class JsonlBackend:
    """Appends one JSON object per step to `path`: {"step", "time" (Unix seconds), metrics...},
    and one per eval, alike: its `step` is the one whose weights it evaluated.

    Each line is flushed when written, so a crashed run keeps every step it logged. Non-finite
    values are written as NaN/Infinity, which Python's json reads back.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self._file.write(json.dumps({"step": step, "time": wall_time, **metrics}) + "\n")
        self._file.flush()

    log_eval = log

    def close(self) -> None:
        self._file.close()


class TensorBoardBackend:
    """Scalars to TensorBoard event files in `log_dir`, one per key and step."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step, walltime=wall_time)
        # Flushed every step, so TensorBoard shows a live run and a crash loses nothing.
        self._writer.flush()

    log_eval = log  # TensorBoard takes scalars of earlier steps

    def close(self) -> None:
        self._writer.close()


class WandbBackend:
    """A Weights & Biases run in `run_dir/wandb`; offline unless `mode="online"`."""

    def __init__(
        self,
        run_dir: str | Path,
        project: str = "forge",
        mode: str = "offline",
        name: str | None = None,
    ) -> None:
        import wandb

        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(run_dir),
            mode=mode,
            # One process may hold several runs (tests, sweeps); never reuse another's.
            reinit="create_new",
        )
        self.step = 0  # the newest step logged
        self.eval_keys: set[str] = set()  # those drawn against eval/step

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.step = max(self.step, step)
        self.run.log(dict(metrics), step=step)

    def log_eval(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        # W&B steps only increase, and an eval ends after later steps: it joins the newest
        # step, its keys drawn against eval/step, the step it evaluated.
        if not self.eval_keys:
            self.run.define_metric("eval/step")
        for key in metrics.keys() - self.eval_keys:
            self.run.define_metric(key, step_metric="eval/step")
            self.eval_keys.add(key)
        self.run.log({**metrics, "eval/step": step}, step=self.step)

    def close(self) -> None:
        self.run.finish()
