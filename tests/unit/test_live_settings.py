"""Live control without a run: the fixed list of keys a live run takes, the checks a value
passes before any change, control.jsonl's record (applied up to a step, rewound with the run),
and the door: its secret file is its owner's, a call without the secret or a malformed one is
refused in one line, both files go when the door closes, and one attacher waiting for a step
boundary or gone mid-call holds up no other."""

import asyncio
import json
import os
import socket
import stat

import pytest

from apps.grpo.main import Config
from forge.loop.control_door import ADDRESS_FILE, SECRET_FILE, ControlConfig, opened_door
from forge.loop.live_settings import ControlRecord, LiveKeyError, checked, current, live_key
from forge.serve.attach import ControlError, LiveRun, attach


def test_a_short_name_or_its_dotted_key_names_a_live_setting_and_nothing_else_does():
    assert live_key("lr") == live_key("trainer.optimizer.lr") == "trainer.optimizer.lr"
    assert live_key("max_policy_age") == "buffer.max_policy_age"
    with pytest.raises(LiveKeyError, match=r"^trainer.temperature: cannot change in a live run; "):
        live_key("trainer.temperature")


def test_a_value_is_checked_by_its_sections_before_anything_changes():
    cfg = Config()
    assert checked(cfg, "buffer.max_policy_age", 3.0) == 3
    assert isinstance(checked(cfg, "buffer.max_policy_age", 3.0), int)
    assert checked(cfg, "trainer.optimizer.lr", 1) == 1.0
    with pytest.raises(LiveKeyError, match=r"^buffer.max_policy_age: expected a whole number"):
        checked(cfg, "buffer.max_policy_age", 1.5)
    with pytest.raises(LiveKeyError, match=r"^trainer.loss.kl_coef=0.1: .*reference model"):
        checked(cfg, "trainer.loss.kl_coef", 0.1)  # GRPO's own check, on the whole config
    with pytest.raises(LiveKeyError, match=r"^generator.sampling.max_tokens: must be < max_model"):
        checked(cfg, "generator.sampling.max_tokens", cfg.generator.max_model_len)
    with pytest.raises(LiveKeyError, match="expected a number, got 'fast'"):
        checked(cfg, "trainer.optimizer.lr", "fast")
    assert current(cfg, "buffer.max_policy_age") == 1 and cfg.trainer.loss.kl_coef == 0.0


def test_the_record_applies_changes_up_to_a_step_and_a_rewind_moves_later_ones(tmp_path):
    record = ControlRecord(tmp_path)
    record.append(3, "me", key="trainer.optimizer.lr", old=1e-5, new=2e-6)
    record.append(3, "me", action="pause")
    record.append(6, "me", key="buffer.max_policy_age", old=1, new=2)
    cfg = Config()
    assert record.apply(cfg, up_to=5) == 1
    assert (cfg.trainer.optimizer.lr, cfg.buffer.max_policy_age) == (2e-6, 1)
    cfg = Config()
    assert record.apply(cfg, keep=["trainer.optimizer.lr"]) == 1  # a replay's what-if wins
    assert cfg.trainer.optimizer.lr == Config().trainer.optimizer.lr
    assert cfg.buffer.max_policy_age == 2
    record.rewind(4)  # back at checkpoint 4: step 5 is the first taken again, under both
    assert [r["step"] for r in record.rows()] == [3, 3, 5]
    record.rewind(-1)  # a run that never took a step keeps nothing
    assert record.rows() == []


async def test_the_door_serves_its_owner_only_and_leaves_nothing_when_closed(tmp_path, capsys):
    async def echo(value: int, by: str) -> dict:
        return {"value": value, "by": by}

    async def refuse(by: str) -> None:
        raise LiveKeyError("checkpoint: this run has trainer.checkpoint.enabled false")

    calls = {"echo": echo, "refuse": refuse}
    async with opened_door(tmp_path, ControlConfig(), calls):
        assert stat.S_IMODE(os.stat(tmp_path / SECRET_FILE).st_mode) == 0o600
        address = json.loads((tmp_path / ADDRESS_FILE).read_text())
        assert address["host"] == "127.0.0.1" and address["pid"] == os.getpid()
        run = attach(tmp_path)
        answer = await asyncio.to_thread(run._call, "echo", value=7)
        assert answer == {"value": 7, "by": run.by}
        with pytest.raises(ControlError, match="^checkpoint: this run has trainer.checkpoint"):
            await asyncio.to_thread(run._call, "refuse")
        with pytest.raises(ControlError, match=r"^no call 'reset' \(calls: echo, refuse\)"):
            await asyncio.to_thread(run._call, "reset")
        stranger = LiveRun(tmp_path)
        stranger._secret = lambda: "f" * 64
        with pytest.raises(ControlError, match="^refused: wrong or missing secret"):
            await asyncio.to_thread(stranger._call, "echo", value=1)
        assert await asyncio.to_thread(_raw, address, b"not json\n") == {
            "error": 'malformed call: expected {"secret", "call", "args"} on one line'
        }
    assert "live: refused a call of 'echo'" in capsys.readouterr().out
    assert not (tmp_path / SECRET_FILE).exists() and not (tmp_path / ADDRESS_FILE).exists()
    with pytest.raises(ControlError, match="no running run to attach to"):
        attach(tmp_path)


def test_the_door_listens_on_this_host_only_but_in_a_slurm_job_on_the_nodes_address(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.0.0.5")
    assert ControlConfig().bind_address() == "127.0.0.1"
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # a `forge submit` job's driver
    assert ControlConfig().bind_address() == "10.0.0.5"
    assert ControlConfig(host="127.0.0.1").bind_address() == "127.0.0.1"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # no other address
    assert ControlConfig().bind_address() == "127.0.0.1"


async def test_two_attachers_at_once_and_one_that_dies_mid_call(tmp_path):
    released, waiting = asyncio.Event(), asyncio.Event()

    async def boundary(by: str) -> str:  # as `set` does: answered at the next step boundary
        waiting.set()
        await released.wait()
        return "taken"

    async def status(by: str) -> str:
        return "running"

    async with opened_door(tmp_path, ControlConfig(), {"boundary": boundary, "status": status}):
        first, second = attach(tmp_path), attach(tmp_path)
        asked = asyncio.ensure_future(asyncio.to_thread(first._call, "boundary"))
        await waiting.wait()
        assert await asyncio.to_thread(second._call, "status") == "running"  # not held up
        address = json.loads((tmp_path / ADDRESS_FILE).read_text())
        dead = socket.create_connection((address["host"], address["port"]))
        dead.sendall(b'{"secret": "' + first._secret().encode() + b'", "call": "boundary"}\n')
        dead.close()  # an attacher gone before its answer
        released.set()
        assert await asked == "taken"
        assert await asyncio.to_thread(second._call, "status") == "running"


def _raw(address: dict, line: bytes) -> dict:
    with socket.create_connection((address["host"], address["port"]), timeout=30) as s:
        s.sendall(line)
        return json.loads(s.makefile("rb").readline())
