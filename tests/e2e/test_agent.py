"""Agent runs end to end, through `python -m forge run` on real processes and vLLM: GRPO on
episodes of several turns whose environments live in EnvironmentActor replicas."""

import os
import re
import signal

import pytest
from helper_runs import (
    complete_groups,
    console,
    eval_metrics,
    evals,
    finish,
    forge_run,
    metrics,
    processes_with_env,
    trained,
    wait_for_steps,
)

pytestmark = pytest.mark.integration

TINY = "configs/agent/tiny_cpu.yaml"
HANG_EVERY = 3  # of some 15 rows taken, one at least hangs but for a chance of (2/3)^15
# Above the time a SIGKILLed replica takes to be known dead: its episodes' steps fail then
# (and the episodes start again) rather than time out.
STEP_TIMEOUT_S = 10.0


def test_a_killed_environment_replica_and_hanging_environments_stall_nothing(tmp_path):
    """configs/agent/tiny_cpu.yaml (guess-a-number in two replicas) with environments whose
    steps take a while, and that never answer on one row in HANG_EVERY; one replica is
    SIGKILLed after step 2. Its episodes start again on the other (counted restarts), the hung
    ones time out and drop their groups (counted), the run trains every step, and no episode
    trains twice or half its group."""
    run_dir = tmp_path / "agent"
    proc = forge_run(
        "grpo",
        TINY,
        run_dir,
        "env.factory=helper_envs:SlowGuess",
        f"env.options={{step_s: 0.2, hang_every: {HANG_EVERY}}}",
        f"env.limits.step_timeout_s={STEP_TIMEOUT_S}",
        "env_resources.env={FORGE_TEST_ROLE: environment}",
        "steps=6",
        "eval.interval=3",
        "eval.size=4",
        "export_hf=false",
    )
    wait_for_steps(proc, run_dir, 2)
    replicas = processes_with_env(proc.pid, "FORGE_TEST_ROLE", "environment")
    assert len(replicas) == 2, replicas
    os.kill(replicas[0], signal.SIGKILL)
    finish(proc, run_dir)

    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == list(range(1, 7))
    assert sum(m.get("env/restarts", 0) for m in steps) >= 1
    dropped = re.findall(
        r"(\d) of its 4 episodes ended by the environment \((\w+)", console(run_dir)
    )
    assert dropped and set(dropped) == {("4", "timeout")}  # hung rows' groups, nothing else
    # Counted as they are said (a group dropped after the last step is in no step's metrics).
    assert sum(m.get("rollout/failed_groups", 0) for m in steps) <= len(dropped)
    assert sum(m.get("env/timeouts", 0) for m in steps) <= 4 * len(dropped)
    complete_groups(run_dir, 4, steps)
    records = trained(run_dir)
    assert not [r for s in records for r in s["rows"] if r % HANG_EVERY == 0]
    assert max(t for s in records for t in s["turns"]) == 3  # "higher"/"lower", then more
    assert all(m["train/mismatch_kl"] < 1e-3 for m in steps)  # over the sampled tokens only
    # Eval plays the same environment, greedily: before step 1, ..., after step 6.
    versions = [e["version"] for e in evals(run_dir, "reward")]
    assert versions[0] == 0 and versions[-1] == 6
    assert any(m.get("eval/env/turns", 0) > 1 for m in eval_metrics(run_dir))
