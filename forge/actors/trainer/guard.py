"""The divergence guard: a step that blows up is not applied.

A blow-up is a non-finite loss or gradient norm, or a gradient norm above `grad_norm_ratio`
times the median of the last `window` applied steps' (once `window` steps were applied). Every
rank reaches the same verdict: it reads global figures only. Its history is part of the
trainer's checkpoint, so a resumed run or a replay judges each step as the run did.
"""

import math
import statistics
from typing import Any

from forge.actors.trainer.config import GuardConfig


class Guard:
    """Judges each step before it is applied (`verdict`), and remembers applied ones."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.norms: list[float] = []  # the last `window` applied steps' gradient norms

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """Why a step of this loss and gradient norm must not be applied; None if it may."""
        if self.cfg.action == "off":
            return None
        if not math.isfinite(loss):
            return f"loss {loss}"
        if not math.isfinite(grad_norm):
            return f"grad norm {grad_norm}"
        if len(self.norms) >= self.cfg.window:  # more: a what-if shrank the window
            median = statistics.median(self.norms[-self.cfg.window :])
            if grad_norm > self.cfg.grad_norm_ratio * median:
                return (
                    f"grad norm {grad_norm:.4g} > {self.cfg.grad_norm_ratio:g} x {median:.4g}, "
                    f"the median of the last {self.cfg.window} steps"
                )
        return None

    def applied(self, grad_norm: float) -> None:
        """Adds an applied step's gradient norm to the history."""
        self.norms = [*self.norms, grad_norm][-self.cfg.window :]

    def state_dict(self) -> dict[str, Any]:
        """The history, for the trainer's checkpoint."""
        return {"norms": list(self.norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""
        self.norms = list(state["norms"])
