"""What a run's folder says of the run, for `forge status RUN_DIR`: whether it runs, its step
and pace, its rewards, where its time goes, its newest checkpoint.

It reads only the folder (config.yaml, metrics.jsonl, timeline.jsonl, startup.jsonl, the
checkpoints), so it works on a run started anywhere and on one long finished. Whether the run's
driver is alive is known on the driver's host (startup.jsonl names its pid and host); elsewhere
the status says when the run last wrote a step.
"""

import itertools
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Literal

import psutil
import yaml

from forge.actors.trainer.checkpoint_folder import latest_step
from forge.loop.run_folder import CHECKPOINTS, CONFIG
from forge.observability.jsonl import read_jsonl
from forge.observability.startup import process_started, read_phases
from forge.observability.timeline import read_timeline

State = Literal["running", "finished", "stopped", "elsewhere"]
PACE_STEPS = 10  # the newest steps that the pace and the phases' shares are taken over
EVAL_ROW = "eval/version"  # a metrics row of an eval, not of a step


@dataclass
class RunStatus:
    """A run as its folder shows it."""

    run_dir: Path
    state: State  # elsewhere: the driver runs on another host, `host`
    steps: int  # the config's
    step: int  # the newest step logged
    checkpoint: int  # the newest complete checkpoint's step (0: none)
    pid: int | None = None  # the driver's, while it runs here
    host: str | None = None
    s_per_step: float | None = None  # median over the newest steps
    last_step_age_s: float | None = None  # since the newest step was logged
    rollout_reward: float | None = None
    eval_reward: tuple[int, float] | None = None  # (step, reward) of the newest eval
    phases: dict[str, float] = field(default_factory=dict)  # "lane: what" -> share of the wall

    @property
    def eta_s(self) -> float | None:
        """Seconds to the last step at the current pace, while the run runs."""
        if self.state not in ("running", "elsewhere") or self.s_per_step is None:
            return None
        return (self.steps - self.step) * self.s_per_step


def read_status(run_dir: str | Path) -> RunStatus:
    """The run in `run_dir` as its folder shows it now.

    Raises:
        FileNotFoundError: `run_dir` holds no run (no config.yaml).
    """
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG).exists():
        raise FileNotFoundError(f"{run_dir} holds no run (no {CONFIG})")
    cfg = yaml.safe_load((run_dir / CONFIG).read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if EVAL_ROW not in r]
    evals = [r for r in rows if EVAL_ROW in r and "eval/reward" in r]
    checkpoints = run_dir / CHECKPOINTS if cfg["trainer"]["checkpoint"]["enabled"] else None
    step = steps[-1]["step"] if steps else 0
    pid, host, started = _driver(run_dir)
    state = _state(pid, host, step, cfg["steps"])
    status = RunStatus(run_dir, state, cfg["steps"], step, latest_step(checkpoints), pid, host)
    if steps:
        status.last_step_age_s = time.time() - steps[-1]["time"]
        status.rollout_reward = next(
            (r["rollout/reward"] for r in reversed(steps) if "rollout/reward" in r), None
        )
    # The pace of the driver's own steps: a resumed run's first ones follow its downtime.
    recent = [r for r in steps if r["time"] > started][-PACE_STEPS - 1 :]
    if len(recent) > 1:
        status.s_per_step = median(b["time"] - a["time"] for a, b in itertools.pairwise(recent))
        status.phases = _phases(run_dir, recent[1]["step"], recent[-1]["step"])
    if evals:
        status.eval_reward = (evals[-1]["step"], evals[-1]["eval/reward"])
    return status


def render(status: RunStatus) -> str:
    """The status as the lines `forge status` prints."""
    s = status
    where = {
        "running": f"running (pid {s.pid})",
        "finished": "finished",
        "stopped": "stopped (the same command resumes it)",
        "elsewhere": f"started on {s.host}",
    }[s.state]
    lines = [f"{s.run_dir}: {where}, step {s.step} of {s.steps}, checkpoint {s.checkpoint}"]
    pace = []
    if s.s_per_step is not None:
        pace.append(f"{s.s_per_step:.3g} s/step")
    if s.eta_s is not None:
        pace.append(f"about {_duration(s.eta_s)} to go")
    if s.last_step_age_s is not None and s.state != "finished":
        pace.append(f"last step {_duration(s.last_step_age_s)} ago")
    if pace:
        lines.append("pace: " + ", ".join(pace))
    rewards = []
    if s.rollout_reward is not None:
        rewards.append(f"rollout {s.rollout_reward:.4g}")
    if s.eval_reward is not None:
        rewards.append(f"eval {s.eval_reward[1]:.4g} (step {s.eval_reward[0]})")
    if rewards:
        lines.append("reward: " + ", ".join(rewards))
    if s.phases:
        shares = sorted(s.phases.items(), key=lambda kv: -kv[1])
        lines.append("time: " + ", ".join(f"{k} {v:.0%}" for k, v in shares))
    return "\n".join(lines)


def _state(pid: int | None, host: str | None, step: int, steps: int) -> State:
    if step >= steps:  # a notebook's kernel, its driver, lives on after the run
        return "finished"
    if pid is not None:
        return "running"
    return "elsewhere" if host not in (None, socket.gethostname()) else "stopped"


def _driver(run_dir: Path) -> tuple[int | None, str | None, float]:
    """The run's newest driver: its pid if it runs on this host (else None), its host, and
    when it started (0.0: not recorded)."""
    boots = [
        r
        for r in read_phases(run_dir / "startup.jsonl")
        if r["role"] == "controller" and r["what"] == "process boot"
    ]
    if not boots:
        return None, None, 0.0
    boot = boots[-1]
    host, pid = boot.get("host"), boot["pid"]
    if host not in (None, socket.gethostname()):
        return None, host, boot["start"]
    try:  # the same clock the driver recorded its start with; another process has another
        alive = abs(process_started(pid) - boot["start"]) < 1.0
        alive = alive and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        alive = False
    return (pid if alive else None), host, boot["start"]


def _phases(run_dir: Path, first: int, last: int) -> dict[str, float]:
    """Each lane kind's phases' share of the wall time of steps `first`..`last`."""
    spans = [s for s in read_timeline(run_dir) if first <= s.get("step", 0) <= last]
    if not spans:
        return {}
    wall = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    if wall <= 0:
        return {}
    busy: dict[tuple[str, str], float] = defaultdict(float)
    lanes: dict[str, set[str]] = defaultdict(set)
    for s in spans:
        kind = s["lane"].rstrip("0123456789 ")  # "generator 1" is a lane of kind "generator"
        busy[kind, s["what"]] += s["end"] - s["start"]
        lanes[kind].add(s["lane"])
    # A kind with several lanes (generator 0, generator 1) shares out per lane.
    return {f"{k}: {what}": t / (wall * len(lanes[k])) for (k, what), t in busy.items()}


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
