"""`forge.attach(run_dir)`: a handle on a running run, from a notebook cell or a script on the
run's host (or wherever its `control.host` lets in), for whoever can read its secret.

    run = forge.attach("runs/grpo")
    run.status()["step"], run.samples(2)[0]["text"]
    run.set(lr=5e-6, max_policy_age=2)     # the step they take effect at
    run.pause(); run.resume(); run.checkpoint(); run.scale("generator", 2); run.stop()

Each call is a line of JSON to the driver's control door (forge.loop.control_door) and its
answer; the run takes settings at its next step boundary (forge.loop.live_control) and records
every change in control.jsonl. The folder's own logs (metrics, the plot) are read here.
"""

import getpass
import ipaddress
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from forge.loop.control_door import ADDRESS_FILE, SECRET_FILE
from forge.loop.status import read_status
from forge.observability.jsonl import read_jsonl
from forge.observability.plot import PLOT_KEYS, plot_series


class ControlError(RuntimeError):
    """A call the run refused or could not take; one line says why."""


class LiveRun:
    """A running run, attached to (`forge.attach`).

    Args:
        run_dir: the run's folder.
        timeout_s: how long a call waits for its answer (settings wait for a step boundary).
    """

    def __init__(self, run_dir: str | Path, timeout_s: float = 900.0) -> None:
        self.run_dir = Path(run_dir)
        self.timeout_s = timeout_s
        self.by = f"{os.getpid()}@{socket.gethostname()}"

    # --- the run's own answers ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What `forge status` shows, with what only the running driver knows: the buffer,
        the admission gate, each generator replica, the settings in force, whether paused."""
        return self._call("status")

    def samples(self, n: int = 4) -> list[dict[str, Any]]:
        """The newest trained batch's first `n` episodes: prompt, text, reward and each reward
        function's score, advantage, and the policy versions of its tokens."""
        return self._call("samples", n=n)

    def set(self, changes: dict[str, Any] | None = None, **settings: Any) -> int:
        """Changes settings from the next step boundary on; returns that step. Names are the
        short ones (`lr=1e-6`) or dotted keys (`{"buffer.max_policy_age": 2}`);
        docs/live_control.md lists those a live run takes. Any other is refused in one line."""
        return self._call("set", changes={**(changes or {}), **settings})["step"]

    def pause(self) -> int:
        """Stops new rollout groups (those started finish; the trainer takes what is
        buffered); returns the step it holds before."""
        return self._call("pause")["step"]

    def resume(self) -> int:
        """Starts rollout groups again."""
        return self._call("resume")["step"]

    def checkpoint(self) -> int:
        """A checkpoint at the next step boundary; returns its step."""
        return self._call("checkpoint")["step"]

    def eval(self) -> int:
        """An eval at the next step boundary; returns the step of the weights it scores."""
        return self._call("eval")["step"]

    def stop(self) -> int:
        """Ends the run at its next step boundary as Ctrl-C would (final checkpoint, plots,
        export); the same command resumes it. Returns the last step it has taken so far."""
        return self._call("stop")["step"]

    def scale(self, role: str, n: int) -> int:
        """Grows or shrinks `role` ("generator", "environment") to `n` replicas; returns the
        healthy replicas once done."""
        return self._call("scale", role=role, n=n)["replicas"]

    # --- the folder -----------------------------------------------------------------------------

    def metrics(self) -> Any:
        """metrics.jsonl as a pandas DataFrame, a row per step (and per eval)."""
        import pandas

        return pandas.DataFrame(read_jsonl(self.run_dir / "metrics.jsonl"))

    def changes(self) -> list[dict[str, Any]]:
        """control.jsonl: every change and request the run took, oldest first."""
        return read_jsonl(self.run_dir / "control.jsonl")

    def watch(
        self, seconds: float, keys: tuple[str, ...] = PLOT_KEYS, every_s: float = 5.0
    ) -> None:
        """Redraws `keys` over steps in a Jupyter cell every `every_s` seconds, for `seconds`
        or until the run ends; changes taken live are marked."""
        from IPython.display import clear_output, display
        from matplotlib.figure import Figure

        end = time.monotonic() + seconds
        while True:
            series, marks = plot_series(self.run_dir, keys), self._change_steps()
            fig = Figure(figsize=(7, 2.2 * max(len(series), 1)), layout="constrained")
            axes = fig.subplots(len(series) or 1, 1, squeeze=False)[:, 0]
            for ax, (key, (steps, values)) in zip(axes, series.items(), strict=False):
                ax.plot(steps, values, marker=".")
                for step in marks:
                    ax.axvline(step, color="tab:red", alpha=0.4, linestyle="--")
                ax.set_title(key, fontsize="medium")
            clear_output(wait=True)
            display(fig)
            if time.monotonic() >= end or read_status(self.run_dir).state != "running":
                return
            time.sleep(every_s)

    def _change_steps(self) -> list[int]:
        return sorted({row["step"] for row in self.changes() if "key" in row})

    @property
    def loopback(self) -> bool:
        """Whether the run listens on its host's loopback only (another host cannot attach)."""
        return ipaddress.ip_address(self._address()["host"]).is_loopback

    # --- the wire --------------------------------------------------------------------------------

    def _call(self, name: str, **args: Any) -> Any:
        address, secret = self._address(), self._secret()
        line = json.dumps({"secret": secret, "call": name, "args": args, "by": self.by})
        target = (address["host"], address["port"])
        try:
            with socket.create_connection(target, timeout=self.timeout_s) as s:
                s.sendall(line.encode() + b"\n")
                answer = json.loads(s.makefile("rb").readline() or b"null")
        except (ConnectionError, TimeoutError, OSError) as e:
            raise ControlError(f"{self.run_dir}: no answer at {target} ({e})") from None
        if answer is None:
            raise ControlError(f"{self.run_dir}: the run ended before it answered {name}")
        if "error" in answer:
            raise ControlError(answer["error"])
        return answer["ok"]

    def _address(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / ADDRESS_FILE).read_text())
        except FileNotFoundError:
            raise ControlError(
                f"{self.run_dir}: no running run to attach to (no {ADDRESS_FILE}); "
                f"`forge status {self.run_dir}` shows what its folder holds"
            ) from None

    def _secret(self) -> str:
        try:
            return (self.run_dir / SECRET_FILE).read_text().strip()
        except PermissionError:
            raise ControlError(
                f"{self.run_dir}: {SECRET_FILE} is its owner's; {getpass.getuser()} cannot attach"
            ) from None


def live_lines(status: dict[str, Any]) -> list[str]:
    """What a running driver adds to `forge status`'s lines (`LiveRun.status()`)."""
    gate, buffer = status["gate"], status["buffer"]
    ages = ", ".join(f"{n} at age {age}" for age, n in status["policy_ages"]) or "empty"
    replicas = ", ".join(
        f"{g['state']} ({g['in_flight']} in flight, {g['queued']} queued)"
        for g in status["generators"]
    )
    changed = ", ".join(f"{k} {v}" for k, v in status["settings"].items())
    return [
        f"rollouts: {'paused' if status['paused'] else 'running'}, "
        f"{gate['buffered'] + gate['in_flight']} of {gate['limit']} ahead of the trainer "
        f"({gate['in_flight']} in flight)",
        f"buffer: {buffer['size']} episodes ({ages})",
        f"generators: {replicas}",
        f"settings: {changed}",
    ]


def attach(run_dir: str | Path, timeout_s: float = 900.0) -> LiveRun:
    """A handle on the run running in `run_dir` (`LiveRun`).

    Raises:
        ControlError: no run runs there (its folder holds no control address).
    """
    run = LiveRun(run_dir, timeout_s)
    run._address()
    return run
