"""A memory cgroup a test moves a process into: real limits, not signals sent by the test."""

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


@contextlib.contextmanager
def memory_cgroup(limit: int, leaf: bool = False) -> Iterator[Path]:
    """A new memory cgroup (v1 or v2) whose processes may take `limit` bytes more than they had
    when they joined it (a process's earlier pages stay charged where they were); yields its
    `cgroup.procs`, to move a process in. With `leaf`, the process goes in a child of the
    limited group instead, which (on v2) hands the memory and pids controllers down, as a
    SLURM job step does for its tasks. Removed once its processes are gone."""
    v2 = (ROOT / "cgroup.controllers").exists()
    group = (ROOT if v2 else ROOT / "memory") / f"forge-test-mem-{uuid.uuid4().hex[:8]}"
    made = [group]
    group.mkdir()
    try:
        (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
        if leaf:
            if v2:
                (group / "cgroup.subtree_control").write_text("+memory +pids")
            made.append(group / "runner")
            made[-1].mkdir()
        yield made[-1] / "cgroup.procs"
    finally:
        for folder in reversed(made):
            _remove(folder)


def _remove(group: Path) -> None:
    """Removes `group` once its processes are gone (a bounded wait)."""
    deadline = time.monotonic() + 30
    while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    group.rmdir()
