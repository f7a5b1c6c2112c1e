"""A trainer's checkpoint folder: its settings (CheckpointConfig), where each step's checkpoint
lives, and which complete one is the newest. Writing and loading them with
torch.distributed.checkpoint is `checkpointing.py`'s, which the trainer imports as it starts.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

LATEST = "latest"


@dataclass
class CheckpointConfig:
    """Whether, how often and where to checkpoint.

    Args:
        enabled: whether a run checkpoints (into its folder's checkpoints/); false: the run
            cannot be continued.
        folder: where the trainer writes them; None: nowhere. A run's config derives it
            (RunConfig: run_dir/checkpoints, or None when not `enabled`), so no yaml sets it;
            a trainer built on its own (tests, benchmarks) is given it.
        interval: save every this many steps (0: only at the end of the run).
        keep: how many checkpoints to keep (older ones are deleted).
        async_save: write the files in the background while training goes on.
    """

    enabled: bool = True
    folder: str | None = None
    interval: int = 0
    keep: int = 2
    async_save: bool = True

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "folder": "derived: a run's checkpoints live in run_dir/checkpoints; "
        "trainer.checkpoint.enabled: false turns them off",
    }

    def __post_init__(self) -> None:
        if self.interval < 0 or self.keep < 1:
            raise ValueError(f"need interval >= 0 and keep >= 1, got {self.interval}, {self.keep}")


def step_folder(folder: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` lives."""
    return Path(folder) / f"step-{step}"


def latest_step(folder: str | Path | None) -> int:
    """The step of the newest complete checkpoint in `folder`; 0 if there is none."""
    latest = Path(folder) / LATEST if folder else None
    if latest is None or not latest.exists():
        return 0
    return step_of(Path(latest.read_text().strip()))


def complete_steps(folder: str | Path) -> list[int]:
    """The steps of the complete checkpoints in `folder`, oldest first: those DCP finished
    (it writes `.metadata` last) up to the one `latest` names (a newer folder may hold the
    driver's part of the next checkpoint only)."""
    folder = Path(folder)
    newest = latest_step(folder)
    done = (step_of(p) for p in folder.glob("step-*") if (p / ".metadata").exists())
    return sorted(s for s in done if s <= newest)


def step_of(folder: Path) -> int:
    """The step a checkpoint folder `step-<n>` holds."""
    return int(folder.name.removeprefix("step-"))
