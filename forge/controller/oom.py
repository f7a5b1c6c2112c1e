"""Which processes the kernel's OOM killer ended, read from the kernel's log (/dev/kmsg).

A process the OOM killer ends dies of SIGKILL, as one a person killed does: only the kernel's
log tells the two apart, and says how much memory the process held. Reading the log needs the
right to (root, or `kernel.dmesg_restrict = 0`); where it is refused, no death is told apart.
"""

import os
import re
from collections.abc import Collection

KMSG = "/dev/kmsg"
# The line the kernel logs for each process it kills for memory, cgroup limit or machine.
_KILLED = re.compile(r"Killed process (\d+) \(.*?\) total-vm:\d+kB, anon-rss:(\d+)kB")
# One record of /dev/kmsg; a read must take a whole one.
_RECORD_BYTES = 8192


def oom_kills(pids: Collection[int], since: float) -> dict[int, int]:
    """Each process of `pids` the OOM killer ended after `since` (time.monotonic() seconds,
    the kernel log's clock), with the anonymous memory it held then, in bytes. Empty where the
    kernel log cannot be read."""
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return {}
    killed = {}
    try:
        while (record := _next_record(fd)) is not None:
            head, _, message = record.partition(";")
            fields = head.split(",")  # priority, sequence number, microseconds since boot, flags
            if len(fields) < 3 or int(fields[2]) / 1e6 < since:
                continue
            match = _KILLED.search(message)
            if match is not None and int(match[1]) in pids:
                killed[int(match[1])] = int(match[2]) << 10
    finally:
        os.close(fd)
    return killed


def _next_record(fd: int) -> str | None:
    """The next record of the kernel log open at `fd`; None at its end."""
    while True:
        try:
            return os.read(fd, _RECORD_BYTES).decode(errors="replace")
        except BlockingIOError:
            return None
        except BrokenPipeError:
            continue  # overwritten by newer records while being read: go on with those
