"""`forge status`'s reading of a run folder (forge/loop/status.py), on folders written here:
the driver found alive by its pid and start, on another host, or gone; the pace, the time to
go, the newest rewards and each lane's share of the time."""

import json
import os
import socket
from pathlib import Path

import psutil
import yaml

from forge.loop.status import read_status, render


def _folder(tmp_path: Path, steps: int, logged: int, host: str, pid: int, start: float) -> Path:
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"steps": steps, "trainer": {}}))
    rows = [
        {"step": s, "time": 1000.0 + 2 * s, "rollout/reward": s / 10} for s in range(1, 1 + logged)
    ]
    rows.append({"step": 2, "time": 1009.0, "eval/version": 2, "eval/reward": 0.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"st')
    boot = {"role": "controller", "what": "process boot", "start": start, "end": start + 1,
            "pid": pid, "host": host}  # fmt: skip
    (tmp_path / "startup.jsonl").write_text(json.dumps(boot) + "\n")
    spans = [
        {"step": s, "lane": lane, "what": what, "start": 1000 + 2 * s + a, "end": 1000 + 2 * s + b}
        for s in range(1, 1 + logged)
        for lane, what, a, b in (("trainer", "train", 0, 1), ("generator 0", "generate", 0, 2),
                                 ("generator 1", "generate", 0, 1))
    ]  # fmt: skip
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    return tmp_path


def test_a_live_driver_here_is_running_with_its_pace_rewards_and_shares(tmp_path):
    me = psutil.Process(os.getpid())
    status = read_status(_folder(tmp_path, 10, 4, socket.gethostname(), me.pid, me.create_time()))
    assert (status.state, status.pid, status.step, status.checkpoint) == ("running", me.pid, 4, 0)
    assert status.s_per_step == 2.0 and status.eta_s == 12.0
    assert status.rollout_reward == 0.4 and status.eval_reward == (2, 0.5)
    # Steps 1..4 span 8 s: the trainer trains 1 s of each 2, the generators 2 and 1 of 2.
    assert status.phases == {"trainer: train": 0.5, "generator: generate": (8 + 4) / (2 * 8)}
    lines = render(status).splitlines()
    assert lines[0] == f"{tmp_path}: running (pid {me.pid}), step 4 of 10, checkpoint 0"
    assert lines[1].startswith("pace: 2 s/step, about 12 s to go, last step ")
    assert lines[2] == "reward: rollout 0.4, eval 0.5 (step 2)"


def test_a_driver_elsewhere_gone_or_done_is_named_so(tmp_path):
    me = psutil.Process(os.getpid())
    elsewhere = read_status(_folder(tmp_path, 10, 4, "node-7", me.pid, me.create_time()))
    assert elsewhere.state == "elsewhere" and "started on node-7" in render(elsewhere)
    assert elsewhere.eta_s == 12.0
    # Another process under the same pid (a start that differs) is not the driver.
    gone = read_status(_folder(tmp_path, 10, 4, socket.gethostname(), me.pid, 12.0))
    assert gone.state == "stopped" and gone.eta_s is None
    assert "stopped (the same command resumes it), step 4 of 10" in render(gone)
    done = read_status(_folder(tmp_path, 4, 4, socket.gethostname(), me.pid, 12.0))
    assert done.state == "finished" and "last step" not in render(done)
