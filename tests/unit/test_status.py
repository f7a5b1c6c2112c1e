"""`forge status`'s reading of a run folder (forge/loop/status.py), on folders written here:
the driver found alive by its pid and start, on another host, or gone; the pace, the time to
go, the newest rewards and each lane's share of the time."""

import json
import os
import socket
from pathlib import Path

import yaml

from forge.loop.status import read_status, render
from forge.observability.startup import process_started

HERE = socket.gethostname()


def _folder(tmp_path: Path, steps: int, logged: int, host: str, start: float) -> Path:
    """A run folder of `steps` steps, `logged` of them taken 2 s apart after a driver on
    `host`, this process's pid, that started at `start`."""
    config = {"steps": steps, "trainer": {"checkpoint": {"enabled": True}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    t0 = start + 10  # the first step ends 12 s after the driver's start
    rows = [{"step": s, "time": t0 + 2 * s, "rollout/reward": s / 10} for s in range(1, logged + 1)]
    rows.append({"step": 2, "time": t0 + 5, "eval/version": 2, "eval/reward": 0.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"st')
    boot = {"role": "controller", "what": "process boot", "start": start, "end": start + 1,
            "pid": os.getpid(), "host": host}  # fmt: skip
    (tmp_path / "startup.jsonl").write_text(json.dumps(boot) + "\n")
    lanes = (
        ("trainer", "train", 1),
        ("generator 0", "generate", 2),
        ("generator 1", "generate", 1),
    )
    spans = [
        {"step": s, "lane": lane, "what": what, "start": t0 + 2 * s - 2, "end": t0 + 2 * s - 2 + d}
        for s in range(1, logged + 1)
        for lane, what, d in lanes
    ]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    return tmp_path


def test_a_live_driver_here_is_running_with_its_pace_rewards_and_shares(tmp_path):
    status = read_status(_folder(tmp_path, 10, 4, HERE, process_started()))
    assert (status.state, status.pid, status.step, status.checkpoint) == (
        "running",
        os.getpid(),
        4,
        0,
    )
    assert status.s_per_step == 2.0 and status.eta_s == 12.0
    assert status.rollout_reward == 0.4 and status.eval_reward == (2, 0.5)
    # Steps 2..4 span 6 s: the trainer trains 1 s of each 2, the generators 2 and 1 of 2.
    assert status.phases == {"trainer: train": 0.5, "generator: generate": (6 + 3) / (2 * 6)}
    lines = render(status).splitlines()
    assert lines[0] == f"{tmp_path}: running (pid {os.getpid()}), step 4 of 10, checkpoint 0"
    assert lines[1].startswith("pace: 2 s/step, about 12 s to go, last step ")
    assert lines[2] == "reward: rollout 0.4, eval 0.5 (step 2)"


def test_a_driver_elsewhere_gone_or_done_is_named_so(tmp_path):
    elsewhere = read_status(_folder(tmp_path, 10, 4, "node-7", process_started()))
    assert elsewhere.state == "elsewhere" and "started on node-7" in render(elsewhere)
    assert elsewhere.eta_s == 12.0
    # The pid is this process's, but the driver's start was another: that driver is gone.
    gone = read_status(_folder(tmp_path, 10, 4, HERE, 12.0))
    assert gone.state == "stopped" and gone.eta_s is None
    assert "stopped (the same command resumes it), step 4 of 10" in render(gone)
    # Finished, whether or not its driver (a notebook's kernel) lives on.
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-4")
    done = read_status(_folder(tmp_path, 4, 4, HERE, process_started()))
    assert done.state == "finished" and done.checkpoint == 4
    assert render(done).startswith(f"{tmp_path}: finished, step 4 of 4, checkpoint 4")
    assert "last step" not in render(done)


def test_pace_counts_only_the_steps_of_the_newest_driver(tmp_path):
    """A run resumed after a pause: the steps logged before its driver started set no pace."""
    start = process_started()
    _folder(tmp_path, 10, 4, HERE, start)  # steps logged 12, 14, 16 and 18 s after `start`
    boot = json.loads((tmp_path / "startup.jsonl").read_text())
    boot["start"] = start + 15  # the resumed run's driver, which has logged steps 3 and 4
    (tmp_path / "startup.jsonl").write_text(json.dumps(boot) + "\n")
    resumed = read_status(tmp_path)
    assert resumed.s_per_step == 2.0 and resumed.phases["trainer: train"] == 0.5
