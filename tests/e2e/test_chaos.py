"""Chaos: one tiny async GRPO run whose every role is SIGKILLed in turn, at seeded moments, the
driver itself included, and that still ends as if nothing had happened.

The run plays guess-a-number in two environment replicas, scores with a reward function and
takes a KL term to a reference model, so it starts every role docs/run_folder.md names
("When a process dies"). Where a kill ends the run (the replay buffer's, the driver's) the test
runs the same command again, as a user or a scheduler would.
"""

import re

import pytest
from helper_chaos import ENDS_RUN, ROLES, Chaos, agent_run, steps_for
from helper_runs import forge_replay, metrics, trained

from forge.weights.shm_folders import SHM_ROOT, owner_of, run_folder

pytestmark = pytest.mark.integration

KILLS = len(ROLES)  # every role once
STEPS = steps_for(KILLS)


def test_a_run_whose_every_role_is_killed_ends_as_if_none_had_been(tmp_path):
    run_dir = tmp_path / "chaos"
    chaos = Chaos(lambda: agent_run(run_dir, STEPS, KILLS), run_dir, kills=KILLS, seed=0)
    assert chaos.run() == 0, chaos.consoles[-1][-2000:]
    for kill in chaos.done:
        print(f"{kill.role} killed after step {kill.at_step}: {kill.recovered_s:.1f}s to the next")
    assert sorted(k.role for k in chaos.done) == sorted(ROLES)
    assert len(chaos.consoles) == 1 + len(ENDS_RUN)

    # Each step once, none missing; no episode trained twice.
    steps = [m["step"] for m in metrics(run_dir)]
    assert steps == list(range(1, STEPS + 1))
    records = trained(run_dir)
    assert [r["step"] for r in records] == steps
    ids = [e for r in records for e in r["episodes"]]
    assert len(ids) == len(set(ids))
    # Every recorded step replays bit-exactly, to the final checkpoint's parameters.
    replayed = forge_replay(run_dir, "--all")
    assert replayed.returncode == 0
    assert f"after step {STEPS}: the same parameters as the final checkpoint" in replayed.stdout

    # Each death said what it was: a recovery in the run, or one line ending it.
    said = "\n".join(chaos.consoles)
    assert "restarted from the checkpoint of step" in said
    (buffer,) = [x for x in said.splitlines() if "ReplayBuffer's process was" in x]
    checkpoint = re.search(r"killed by SIGKILL .* from its checkpoint of step (\d+)", buffer)
    assert checkpoint, buffer
    assert f"resuming at step {checkpoint[1]}" in said
    assert said.count("resuming at step") == len(ENDS_RUN)
    log = (run_dir / "forge.log").read_text()
    assert "reward worker is gone" in log  # the call it held failed, and was counted
    for service in (
        "Generator",
        "EnvironmentActor",
        "RewardActor",
        "DatasetActor",
        "ReferenceModel",
    ):
        assert re.search(rf"^{service} replica \d recovered$", log, re.M), service

    # Nothing left: no process of the run, no shared memory of it or of a process it started.
    assert chaos.left_running() == []
    assert not run_folder(run_dir).exists()
    pids = {pid for pid, _ in chaos.seen}
    left = [f for f in SHM_ROOT.glob("forge-*") if (o := owner_of(f)) and o.pid in pids]
    assert left == []
