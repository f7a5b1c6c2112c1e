"""The settings a running run may change, and the record of every change: control.jsonl.

A change asked of a live run (`forge.attach(run_dir).set(lr=1e-6)`) takes effect at a step
boundary: step k, the first step trained under it. Each change is a row of run_dir/control.jsonl

  {"time": t, "step": k, "by": "pid@host", "key": "trainer.optimizer.lr", "old": 1e-5, "new": 2e-6}

and so are the requests that change no setting (pause, resume, checkpoint, eval, stop, scale:
`"action"` instead of `"key"`). The run's settings at step k are its config.yaml with the rows of
steps <= k applied: a resumed run continues with them, and `forge replay --step k` trains under
them.
"""

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forge.config import FieldError
from forge.observability.jsonl import read_jsonl

CONTROL_LOG = "control.jsonl"

# What may change while a run runs, by its short name: the dotted config key each names. The
# rest shape the batch, the model or the processes, or (the sampling temperature) must agree
# between the generators and the trainer's logprobs.
LIVE_KEYS: dict[str, str] = {
    "lr": "trainer.optimizer.lr",
    "clip_eps_low": "trainer.loss.clip_eps_low",
    "clip_eps_high": "trainer.loss.clip_eps_high",
    "kl_coef": "trainer.loss.kl_coef",
    "max_grad_norm": "trainer.max_grad_norm",
    "max_policy_age": "buffer.max_policy_age",
    "top_p": "generator.sampling.top_p",
    "max_tokens": "generator.sampling.max_tokens",
    "eval_interval": "eval.interval",
    "checkpoint_interval": "trainer.checkpoint.interval",
}


class LiveKeyError(ValueError):
    """A key that cannot change in a live run, or a value its section refuses; one line."""


def live_key(name: str) -> str:
    """The dotted config key that `name` (a short name or the dotted key itself) names.

    Raises:
        LiveKeyError: not one of LIVE_KEYS.
    """
    if name in LIVE_KEYS:
        return LIVE_KEYS[name]
    if name in LIVE_KEYS.values():
        return name
    known = ", ".join(f"{short} ({key})" for short, key in LIVE_KEYS.items())
    raise LiveKeyError(f"{name}: cannot change in a live run; these can: {known}")


def current(cfg: Any, key: str) -> Any:
    """The value of dotted `key` in `cfg`."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def checked(cfg: Any, key: str, value: Any) -> Any:
    """`value` as dotted `key` of `cfg` holds it (an int stays an int), once every section on
    the way has accepted it (their own checks run on a copy; `cfg` is not changed).

    Raises:
        LiveKeyError: a value of another type, or one a section refuses, with its reason.
    """
    old = current(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LiveKeyError(f"{key}: expected a number, got {value!r}")
    if isinstance(old, int) and value != int(value):
        raise LiveKeyError(f"{key}: expected a whole number, got {value!r}")
    value = type(old)(value)
    try:
        _replaced(cfg, key.split("."), value)
    except FieldError as e:  # the section's own field: `key: must be > 0, got -1.0`
        raise LiveKeyError(f"{key}: {e.detail}") from None
    except (ValueError, TypeError) as e:
        raise LiveKeyError(f"{key}={value!r}: {e}") from None
    return value


def _replaced(section: Any, path: list[str], value: Any) -> Any:
    """A copy of `section` with `path` set to `value`, made by each section's constructor."""
    head, *rest = path
    new = _replaced(getattr(section, head), rest, value) if rest else value
    return dataclasses.replace(section, **{head: new})


def assign(cfg: Any, key: str, value: Any) -> None:
    """Sets dotted `key` of `cfg` in place: every part holding `cfg` sees it."""
    *sections, leaf = key.split(".")
    setattr(current(cfg, ".".join(sections)) if sections else cfg, leaf, value)


class ControlRecord:
    """run_dir/control.jsonl: the changes and requests a run took, one row each."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / CONTROL_LOG

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)

    def changes(self, up_to: int | None = None) -> list[dict[str, Any]]:
        """The setting changes in force at step `up_to` (None: all), oldest first."""
        return [r for r in self.rows() if "key" in r and (up_to is None or r["step"] <= up_to)]

    def append(self, step: int, by: str, **row: Any) -> dict[str, Any]:
        """Records a change (`key`, `old`, `new`) or a request (`action`) taken at `step`."""
        row = {"time": time.time(), "step": step, "by": by, **row}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    def apply(
        self, cfg: Any, up_to: int | None = None, keep: Sequence[str] = (), under: str = ""
    ) -> int:
        """Sets the changes in force at step `up_to` (None: all) of the keys `under` a section
        (a replay's trainer takes "trainer.") in `cfg`, but for the keys in `keep` (a replay's
        what-if sets those); returns how many."""
        rows = [
            r for r in self.changes(up_to) if r["key"].startswith(under) and r["key"] not in keep
        ]
        for row in rows:
            assign(cfg, row["key"], row["new"])
        return len(rows)

    def rewind(self, step: int) -> None:
        """A run going back to checkpoint `step` (a resume, a trainer restart) takes steps
        step+1.. again, under every change recorded: one that took effect later takes effect
        at step+1 now. Step -1, a run that never took a step: no change stays."""
        if step < 0:
            self.path.unlink(missing_ok=True)
            return
        rows = self.rows()
        if any(r["step"] > step + 1 for r in rows):
            moved = [{**r, "step": min(r["step"], step + 1)} for r in rows]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in moved))
            tmp.replace(self.path)
