"""Attach overhead: what one attacher polling a run's live status every second costs the run.

One tiny async GRPO run (`forge run`, configs/grpo/tiny_cpu.yaml) is measured in alternating
blocks of `--block` steps: no attacher, then an attacher calling `status()` (the driver asks its
buffer actor, reads its folder and its services) every `--poll` seconds, `--rounds` times
over. The blocks interleave, so a drift of the machine falls on both; each step's time is the
interval between its metrics row and the previous one. Recorded: the median s/step of each,
and with / without (target <= 1.02). The run is then stopped through the attacher.

    python bench/attach.py [--rounds 8] [--block 15] [--poll 1.0]
"""

import argparse
import os
import statistics
import sys
import threading
from pathlib import Path

from library_log import library_output_to_log
from result import ROOT, Result
from scratch import scratch_folder

from forge.observability.console import say
from forge.serve.attach import LiveRun, attach

TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))  # the run is the tests' tiny one, with their varied reward
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))

from helper_runs import finish, forge_run, metrics, wait_for_steps  # noqa: E402

TINY = "configs/grpo/tiny_cpu.yaml"
REWARD = "reward.functions=[helper_rewards:vowel_fraction]"
WARM_UP = 3  # steps before the first block: start-up and the first weight syncs


class Poller:
    """An attacher asking for the run's status every `every_s` seconds, in a thread."""

    def __init__(self, run: LiveRun, every_s: float) -> None:
        self.run, self.every_s = run, every_s
        self.calls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self.run.status()
            self.calls += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def step_times(run_dir: Path, first: int, last: int) -> list[float]:
    """Seconds between the metrics rows of steps first-1 and first, ..., last-1 and last."""
    at = {m["step"]: m["time"] for m in metrics(run_dir)}
    return [at[s] - at[s - 1] for s in range(first, last + 1)]


def main(args: argparse.Namespace) -> None:
    run_dir = scratch_folder("attach") / "run"
    proc = forge_run("grpo", TINY, run_dir, "steps=100000", REWARD, "export_hf=false")
    without: list[float] = []
    with_one: list[float] = []
    calls = 0
    try:
        wait_for_steps(proc, run_dir, WARM_UP)
        run = attach(run_dir)
        step = len(metrics(run_dir))
        for _ in range(args.rounds):
            for attached in (False, True):
                poller = Poller(run, args.poll) if attached else None
                wait_for_steps(proc, run_dir, step + args.block + 1)
                if poller is not None:
                    poller.stop()
                    calls += poller.calls
                # The first step of a block may have begun in the one before.
                times = step_times(run_dir, step + 2, step + args.block + 1)
                (with_one if attached else without).extend(times)
                step = len(metrics(run_dir))
        run.stop()
        finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    a, b = statistics.median(with_one), statistics.median(without)
    result = Result("attach")
    result.figure("s/step, no attacher (median)", b, "s")
    result.figure("s/step, one attacher polling status (median)", a, "s")
    result.figure("status calls answered", calls, "calls")
    result.ratio("s/step with one attacher / with none", a / b, target="<= 1.02")
    say(f"attach: {a:.3f} s/step polled every {args.poll} s, {b:.3f} s/step not: {a / b:.3f}x")
    result.write()


if __name__ == "__main__":
    library_output_to_log("attach")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=15, help="steps per block")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between status calls")
    main(parser.parse_args())
