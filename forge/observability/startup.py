"""The run's start-up, phase by phase: run_dir/startup.jsonl.

Each line is one phase of one process, wall-clock seconds since the epoch:

    {"role": "Generator", "what": "vllm import", "start": 1796543701.2, "end": 1796543709.8,
     "pid": 4242, "host": "node-1"}

The controller names the file in `FORGE_STARTUP_LOG` before it spawns anything, so every
process it starts inherits it and appends its own phases (`phase`); a process started without
it records nothing. `read_phases` reads the file back; `bench/startup.py` draws it.
"""

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from forge.observability.jsonl import read_jsonl

ENV = "FORGE_STARTUP_LOG"


def record(role: str, what: str, start: float, end: float) -> None:
    """Appends one phase (wall-clock `start` and `end`) to the run's start-up log, if any."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = {"role": role, "what": what, "start": start, "end": end, "pid": os.getpid(),
            "host": socket.gethostname()}  # fmt: skip
    # One short write per line in append mode: processes writing at once do not interleave.
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


@contextmanager
def phase(role: str, what: str) -> Iterator[None]:
    """Records the time the block took as `role`'s phase `what` (also when it raises)."""
    start = time.time()
    try:
        yield
    finally:
        record(role, what, start, time.time())


def booted(role: str) -> None:
    """Records this process's boot, from its start to now, as `role`'s, if a log is named."""
    if os.environ.get(ENV):
        record(role, "process boot", process_started(), time.time())


def process_started(pid: int | None = None) -> float:
    """A process's start (this one's by default), wall-clock: what its boot (interpreter,
    imports) began with.

    Raises:
        FileNotFoundError: no process `pid` runs on this host.
    """
    fields = Path(f"/proc/{pid or 'self'}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[19])  # starttime: clock ticks after boot (proc(5), field 22)
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def read_phases(path: str | Path) -> list[dict]:
    """The phases a start-up log holds, in the order they ended."""
    return read_jsonl(path)
