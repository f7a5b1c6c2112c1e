"""Cgroups a test moves a process into: a memory limit, a freeze. Real limits, not signals sent
by the test."""

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
FREEZER = ("FROZEN", "THAWED")  # cgroup v1's freezer.state values


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


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Keeps process `pid` from running (cgroup v1's freezer or v2's cgroup.freeze) until the
    block ends, then puts it back in its group. Unlike SIGSTOP, nothing but the test undoes it:
    the kernel sends SIGCONT to the stopped members of a process group that becomes orphaned."""
    v2 = (ROOT / "cgroup.controllers").exists()
    hierarchy = ROOT if v2 else ROOT / "freezer"
    (home,) = [
        line.split(":", 2)[2]
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        if line.split(":")[1] == ("" if v2 else "freezer")
    ]
    group = hierarchy / f"forge-test-freeze-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    (group / "cgroup.procs").write_text(str(pid))
    state, freeze, thaw = ("cgroup.freeze", "1", "0") if v2 else ("freezer.state", *FREEZER)
    try:
        (group / state).write_text(freeze)
        yield
    finally:
        (group / state).write_text(thaw)
        (hierarchy / home.lstrip("/") / "cgroup.procs").write_text(str(pid))
        group.rmdir()
