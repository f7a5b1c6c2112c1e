"""A memory cgroup a test moves a process into: real limits, not signals sent by the test."""

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A new memory cgroup (v1 or v2) whose processes may take `limit` bytes more than they had
    when they joined it (a process's earlier pages stay charged where they were); yields its
    `cgroup.procs`, to move a process in. Removed once its processes are gone."""
    root, name = Path("/sys/fs/cgroup"), f"forge-test-oom-{uuid.uuid4().hex[:8]}"
    v2 = (root / "cgroup.controllers").exists()
    group = root / name if v2 else root / "memory" / name
    group.mkdir()
    try:
        (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
        yield group / "cgroup.procs"
    finally:
        deadline = time.monotonic() + 30
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        group.rmdir()
