"""Small actors for controller tests; importable by the processes Monarch starts."""

import asyncio
import os
import threading
from pathlib import Path

import torch
from monarch.actor import endpoint
from monarch.actor.concurrent import concurrent_endpoint

from forge.controller import ForgeActor, retry_safe


class Echo(ForgeActor):
    """Answers with its pid; counts calls and the most it ever ran at once."""

    def __init__(self, tag: str = "echo") -> None:
        super().__init__()
        self.tag = tag
        self.calls = 0
        self.running = 0
        self.max_running = 0
        self.recovered_to: int | None = None
        self.setup_done = False

    @endpoint
    async def setup(self) -> None:
        self.setup_done = True

    @concurrent_endpoint
    @retry_safe
    async def work(self, x: int, delay: float = 0.0) -> tuple[int, int]:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(delay)
        finally:
            self.running -= 1
        self.calls += 1
        return os.getpid(), x

    @concurrent_endpoint
    async def unsafe_work(self, x: int, delay: float = 0.0) -> tuple[int, int]:
        await asyncio.sleep(delay)
        return os.getpid(), x

    @endpoint
    async def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    async def hang(self, marker: str) -> None:
        """Touches `marker`, then blocks this actor's thread forever, as a stuck C call or
        collective would: no later message, `ping` included, is ever handled."""
        Path(marker).touch()
        threading.Event().wait()

    @endpoint
    async def recover_to(self, version: int) -> None:
        self.recovered_to = version

    @endpoint
    async def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "tag": self.tag,
            "calls": self.calls,
            "max_running": self.max_running,
            "recovered_to": self.recovered_to,
            "setup_done": self.setup_done,
            "affinity": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads(),
            "env": {k: os.environ.get(k) for k in _ENV_KEYS},
        }


_ENV_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "FORGE_CPUS",
    "FORGE_TEST",
)


class BadSetup(ForgeActor):
    @endpoint
    async def setup(self) -> None:
        raise RuntimeError("setup failed: no model at /nowhere")


class BrokenPing(Echo):
    """An Echo whose `ping` raises while told to, as a faulty health-check override would."""

    def __init__(self) -> None:
        super().__init__()
        self.pings_to_fail = 0

    @endpoint
    async def ping(self) -> int:
        if self.pings_to_fail:
            self.pings_to_fail -= 1
            raise RuntimeError("ping broke on purpose")
        return os.getpid()

    @endpoint
    async def fail_pings(self, n: int) -> None:
        self.pings_to_fail = n
