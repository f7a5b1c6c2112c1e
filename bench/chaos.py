"""Chaos soak: what SIGKILLing a run's processes, one after another, costs it.

One tiny async GRPO run with every role (tests/helper_chaos.py's agent run: environments in
two replicas, a reward function, a KL reference) runs `--steps` steps (by default what the
kills need: `steps_for`) twice: undisturbed, then
with `--kills` SIGKILLs of seeded random roles, the driver included, each after the run has
logged a step since the last one and a seeded delay of up to `--delay` seconds; where a kill
ends the run, the same command runs again. Recorded: the kills survived (the run ends with
every step once), the steps trained again per kill (a restarted trainer's redone steps, a rerun
driver's steps after its checkpoint), the time lost per kill (chaos wall - undisturbed wall,
over the kills), the seconds from each role's kill to the next step, and chaos / undisturbed
wall.

    python bench/chaos.py [--kills 20] [--steps N] [--delay 3] [--seed 0]
"""

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

from library_log import library_output_to_log
from result import ROOT, Result
from scratch import scratch_folder

from forge.observability.console import say

TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))  # the chaos schedule and the run are the chaos test's
# The runs' processes import the test's reward function.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))

from helper_chaos import ENDS_RUN, Chaos, agent_run, steps_for  # noqa: E402
from helper_runs import finish, metrics  # noqa: E402


def undisturbed(folder: Path, steps: int) -> float:
    """Wall seconds of the run with no kill."""
    run_dir = folder / "undisturbed"
    start = time.monotonic()
    finish(agent_run(run_dir, steps, 0), run_dir)
    return time.monotonic() - start


def redone_steps(chaos: Chaos) -> int:
    """Steps trained twice: by a restarted trainer (its metric) and after each rerun's resume."""
    rows = metrics(chaos.run_dir)
    trainer = sum(m.get("trainer/redone_steps", 0) for m in rows)
    ended = [k for k in chaos.done if k.ended_run]
    resumed = [re.search(r"resuming at step (\d+)", c) for c in chaos.consoles[1:]]
    rerun = sum(k.at_step - int(m[1]) for k, m in zip(ended, resumed, strict=True) if m)
    return int(trainer + rerun)


def main(args: argparse.Namespace) -> None:
    args.steps = args.steps or steps_for(args.kills)
    folder = scratch_folder("chaos")
    clean_s = undisturbed(folder, args.steps)
    say(f"undisturbed: {args.steps} steps in {clean_s:.0f} s")
    run_dir = folder / "chaos"
    start = time.monotonic()
    chaos = Chaos(
        lambda: agent_run(run_dir, args.steps, args.kills),
        run_dir,
        kills=args.kills,
        seed=args.seed,
        max_delay_s=args.delay,
    )
    if chaos.run() != 0:
        raise SystemExit(f"chaos: the run failed: {chaos.consoles[-1][-1500:]}")
    chaos_s = time.monotonic() - start
    steps = [m["step"] for m in metrics(run_dir)]
    if steps != list(range(1, args.steps + 1)):
        raise SystemExit(f"chaos: steps logged {steps}, not each of 1..{args.steps} once")
    kills = len(chaos.done)
    result = Result("chaos")
    result.figure("kills survived", kills, "kills")
    result.figure("of which ended the run (rerun)", sum(k.ended_run for k in chaos.done), "kills")
    result.figure("steps trained again per kill", redone_steps(chaos) / kills, "steps")
    result.figure("time lost per kill", (chaos_s - clean_s) / kills, "s")
    result.ratio("chaos wall / undisturbed wall", chaos_s / clean_s)
    for role in sorted({k.role for k in chaos.done}):
        times = [k.recovered_s for k in chaos.done if k.role == role]
        how = "rerun" if role in ENDS_RUN else "in the run"
        result.figure(
            f"{role} killed: to the next step ({how}), median", statistics.median(times), "s"
        )
    say(f"chaos: {kills} kills survived in {chaos_s:.0f} s (undisturbed {clean_s:.0f} s)")
    result.write()


if __name__ == "__main__":
    library_output_to_log("chaos")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, help="default: steps_for(kills)")
    parser.add_argument("--delay", type=float, default=3.0, help="most seconds before a kill")
    parser.add_argument("--seed", type=int, default=0)
    main(parser.parse_args())
