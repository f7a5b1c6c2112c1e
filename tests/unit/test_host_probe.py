"""The probe that finds a `forge submit` job's lost node, on real sockets: a node is lost only
when two connection attempts a pause apart both fail."""

import socket

from forge.controller.slurm import launcher
from forge.controller.slurm.launcher import unreachable_twice


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_listening_worker_is_not_lost():
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert unreachable_twice("127.0.0.1", server.getsockname()[1]) is None


def test_nothing_listening_twice_is_lost_and_says_why():
    why = unreachable_twice("127.0.0.1", closed_port())
    assert why is not None and why.startswith("is unreachable (Connection refused)"), why
    assert why.endswith(f"twice {launcher.HOST_PROBE_PAUSE_S:g}s apart")


def test_a_worker_that_listens_again_by_the_second_try_is_not_lost(monkeypatch):
    port, server = closed_port(), []

    def pause(seconds: float) -> None:  # the worker's listener is back meanwhile
        assert seconds == launcher.HOST_PROBE_PAUSE_S
        server.append(socket.create_server(("127.0.0.1", port)))

    monkeypatch.setattr(launcher.time, "sleep", pause)
    try:
        assert unreachable_twice("127.0.0.1", port) is None
        assert server  # the first attempt failed: it paused
    finally:
        for s in server:
            s.close()
