"""Live control: a tiny async GRPO run started by `forge run` in its own process group is
attached to from this process (`forge.attach`). Its status agrees with its folder; a learning
rate set at step k is the trainer's `lr` from step k; a raised `buffer.max_policy_age` raises
what the admission gate lets ahead; a second generator replica joins; pause stops new groups
while training drains the buffer, and resume starts them again; a key outside the list and a
caller without the secret are refused in one line. The run is then SIGKILLed and run again: it
continues under the changed settings, each step once, and a step trained after the change
replays bit-exactly."""

import json
import os
import stat

import pytest
from helper_runs import (
    _kill_group,
    console,
    finish,
    forge_replay,
    forge_run,
    forge_status,
    metrics,
    trained,
    wait_for_steps,
    wait_until,
)

import forge
from forge.serve.attach import ControlError, LiveRun

pytestmark = pytest.mark.integration

TINY = "configs/grpo/tiny_cpu.yaml"
RUN = (
    "trainer.checkpoint.interval=1",
    "record.batches=all",
    "export_hf=false",
    "reward.functions=[helper_rewards:vowel_fraction]",
)
BATCH = 8  # tiny_cpu.yaml's buffer.batch_size


async def test_attach_steers_a_running_run_and_its_record_survives_a_kill(tmp_path):
    run_dir = tmp_path / "live"
    proc = forge_run("grpo", TINY, run_dir, "steps=1000", *RUN)
    try:
        wait_for_steps(proc, run_dir, 1)
        run = forge.attach(run_dir)
        assert stat.S_IMODE(os.stat(run_dir / "control.secret").st_mode) == 0o600
        _status_agrees_with_the_folder(run, proc.pid, run_dir)
        _refuses_keys_outside_the_list_and_callers_without_the_secret(run, run_dir)

        lr_from = run.set(lr=2e-5)
        age_from = run.set(max_policy_age=2)
        assert run.status()["gate"]["limit"] == (2 + 1) * BATCH
        assert run.scale("generator", 2) == 2
        assert [g["state"] for g in run.status()["generators"]] == ["healthy", "healthy"]
        shown = forge_status(run_dir)  # the folder's lines, then the driver's
        assert "rollouts: running" in shown and "settings: lr 2e-05" in shown
        await _pause_drains_and_resume_restarts(run, proc, run_dir)

        sample = run.samples(2)
        assert len(sample) == 2 and isinstance(sample[0]["text"], str)
        assert {"prompt", "reward", "rewards", "advantage", "versions"} <= sample[0].keys()
        wait_for_steps(proc, run_dir, age_from + 1)
    finally:
        _kill_group(proc)

    lrs = {m["step"]: m["train/lr"] for m in metrics(run_dir)}
    assert {s: lr for s, lr in lrs.items() if s < lr_from} == dict.fromkeys(range(1, lr_from), 1e-4)
    assert {lr for s, lr in lrs.items() if s >= lr_from} == {2e-5}
    changes = [json.loads(line) for line in (run_dir / "control.jsonl").read_text().splitlines()]
    keys = [(c["step"], c["key"], c["new"]) for c in changes if "key" in c]
    assert keys == [(lr_from, "trainer.optimizer.lr", 2e-5), (age_from, "buffer.max_policy_age", 2)]
    assert [c["action"] for c in changes if "action" in c] == ["scale", "pause", "resume"]

    # Run again after the kill: the changes are in force again, each step is taken once.
    done = len(metrics(run_dir)) + 2
    finish(forge_run("grpo", TINY, run_dir, f"steps={done}", *RUN), run_dir)
    assert "2 live changes in force" in console(run_dir)
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == list(range(1, done + 1))
    assert {m["train/lr"] for m in logged if m["step"] >= lr_from} == {2e-5}
    episodes = [e for record in trained(run_dir) for e in record["episodes"]]
    assert len(episodes) == len(set(episodes))
    replayed = forge_replay(run_dir, "--step", str(lr_from + 1))
    assert replayed.returncode == 0 and "replayed bit-exactly" in replayed.stdout


def _status_agrees_with_the_folder(run: LiveRun, pid: int, run_dir) -> None:
    status = run.status()
    assert (status["state"], status["pid"], status["steps"]) == ("running", pid, 1000)
    logged = {m["step"]: m for m in metrics(run_dir)}
    assert status["step"] in logged and status["step"] <= status["version"]
    assert status["rollout_reward"] == logged[status["step"]]["rollout/reward"]
    assert status["settings"]["lr"] == 1e-4 and status["settings"]["max_policy_age"] == 1
    assert status["gate"]["limit"] == (1 + 1) * BATCH and not status["paused"]


def _refuses_keys_outside_the_list_and_callers_without_the_secret(run: LiveRun, run_dir) -> None:
    with pytest.raises(ControlError, match=r"^generator.model: cannot change in a live run; these"):
        run.set(**{"generator.model": "SmolLM2-135M-Instruct"})
    with pytest.raises(ControlError, match=r"^trainer.optimizer.lr: must be > 0, got -1.0$"):
        run.set(lr=-1)
    stranger = LiveRun(run_dir)
    stranger._secret = lambda: "0" * 64
    with pytest.raises(ControlError, match="^refused: wrong or missing secret"):
        stranger.status()
    assert "live: refused a call of 'status'" in console(run_dir)


async def _pause_drains_and_resume_restarts(run: LiveRun, proc, run_dir) -> None:
    run.pause()

    def drained() -> bool:  # no group in flight, and too few buffered for another step
        status = run.status()
        return status["gate"]["in_flight"] == 0 and status["buffer"]["size"] < BATCH

    # Running, the gate keeps groups in flight whenever the trainer makes room: never none.
    await wait_until(drained, "the paused run's buffer drained", 300)
    held = len(metrics(run_dir))  # and perhaps a step on the last full batch, still training
    assert run.status()["paused"]
    run.resume()
    wait_for_steps(proc, run_dir, held + 2)
