"""The run's start-up log (forge.observability.startup): phases appended by any process."""

import time

import pytest

from forge.observability import startup


def test_phases_go_to_the_named_log_and_read_back_in_order(tmp_path, monkeypatch):
    log = tmp_path / "startup.jsonl"
    monkeypatch.setenv(startup.ENV, str(log))
    with startup.phase("Generator", "vllm import"):
        pass
    with pytest.raises(ValueError), startup.phase("TitanTrainer", "model build"):
        raise ValueError  # a phase that fails is recorded too
    startup.record("controller", "data", 1.0, 2.0)
    phases = startup.read_phases(log)
    assert [(p["role"], p["what"]) for p in phases] == [
        ("Generator", "vllm import"),
        ("TitanTrainer", "model build"),
        ("controller", "data"),
    ]
    assert all(p["start"] <= p["end"] for p in phases)
    assert phases[2]["start"] == 1.0 and phases[2]["end"] == 2.0


def test_without_a_log_named_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(startup.ENV, raising=False)
    with startup.phase("Generator", "vllm import"):
        pass
    assert startup.read_phases(tmp_path / "startup.jsonl") == []


def test_the_process_started_before_now():
    started = startup.process_started()
    assert started <= time.time() and time.time() - started < 24 * 3600


def test_a_process_boot_runs_from_its_start_to_now(tmp_path, monkeypatch):
    log = tmp_path / "startup.jsonl"
    monkeypatch.setenv(startup.ENV, str(log))
    startup.booted("Generator")
    [boot] = startup.read_phases(log)
    assert boot["what"] == "process boot" and boot["start"] < boot["end"] <= time.time()
