"""SIGTERM (a scheduler, `kill`, `docker stop`) ends a run as Ctrl-C does, within its grace
period; a second SIGTERM ends it at once. Either way no process and no shared memory is left,
and the exit status is 143 (128 + SIGTERM), as a batch script expects. `forge status` tells the
run running, stopped and, resumed to its end, finished."""

import re
import signal

import psutil
import pytest
from helper_runs import (
    console,
    finish,
    forge_run,
    forge_status,
    metrics,
    shm_mapped,
    trained,
    wait_for_steps,
    wait_until,
)

from forge.actors.trainer.checkpoint_folder import latest_step
from forge.weights.shm_folders import run_folder

pytestmark = pytest.mark.integration

TINY = "configs/grpo/tiny_cpu.yaml"
# No periodic checkpoint: the one the run resumes from is the one its end writes.
NO_PERIODIC = "trainer.checkpoint.interval=0"
ONCE = (NO_PERIODIC, "export_hf=false")


async def test_sigterm_ends_a_run_as_ctrl_c_does_and_a_second_one_ends_it_at_once(tmp_path):
    runs = {n: tmp_path / n for n in ("once", "twice")}
    # Side by side: start-up is mostly waiting. "twice" exports at its end, so that its
    # clean end lasts long enough for the second signal to land in it.
    procs = {
        "once": forge_run("grpo", TINY, runs["once"], "steps=1000", *ONCE),
        "twice": forge_run("grpo", TINY, runs["twice"], "steps=1000", NO_PERIODIC),
    }
    ours: dict[str, set] = {}
    processes: list[psutil.Process] = []
    try:
        for name, run_dir in runs.items():
            wait_for_steps(procs[name], run_dir, 2)
            mapped, tree = shm_mapped(procs[name].pid)
            ours[name] = mapped | {run_folder(run_dir)}
            processes += tree[1:]
        running = forge_status(runs["once"])
        assert f"running (pid {procs['once'].pid}), step " in running
        step = int(re.search(r"step (\d+) of 1000", running)[1])
        assert step >= 2 and "s/step" in running and "to go" in running
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        taken = "a second signal ends it at once"
        await wait_until(lambda: taken in console(runs["twice"]), "the first SIGTERM taken", 120)
        procs["twice"].send_signal(signal.SIGTERM)
        codes = {name: proc.wait(timeout=120) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    assert codes == {"once": 143, "twice": 143}
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert {name: sorted(p for p in paths if p.exists()) for name, paths in ours.items()} == {
        "once": [],
        "twice": [],
    }
    named = [line for line in console(runs["once"]).splitlines() if "SIGTERM" in line]
    assert len(named) == 1, named
    assert "SIGTERM again: ended at once" in console(runs["twice"])
    # The final checkpoint is of the last logged step; the run resumes from it, each step once.
    logged = [m["step"] for m in metrics(runs["once"])]
    assert logged == list(range(1, len(logged) + 1)) and latest_step(
        runs["once"] / "checkpoints"
    ) == len(logged)
    stopped = f"stopped (the same command resumes it), step {len(logged)} of 1000, checkpoint "
    assert stopped + str(len(logged)) in forge_status(runs["once"])
    more = len(logged) + 2
    finish(forge_run("grpo", TINY, runs["once"], f"steps={more}", *ONCE), runs["once"])
    assert f"resuming at step {len(logged)}" in console(runs["once"])
    assert f"finished, step {more} of {more}, checkpoint {more}" in forge_status(runs["once"])
    assert [m["step"] for m in metrics(runs["once"])] == list(range(1, more + 1))
    episodes = [e for record in trained(runs["once"]) for e in record["episodes"]]
    assert len(episodes) == len(set(episodes))  # none trained twice
