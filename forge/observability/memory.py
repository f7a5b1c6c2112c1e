"""Peak memory of this process over a span of work (a training step): CPU or GPU.

    peak = PeakMemory(device)   # starts counting from now
    ...
    peak.gb()                   # the most held since: resident set (CPU) or CUDA allocation

On CPU the kernel's high-water mark of the resident set (VmHWM) is reset through
/proc/self/clear_refs, so each span gets its own peak, not the process's lifetime maximum.
Shared memory this process maps (RssShmem: the weight files a trainer keeps mapped to publish
into) is left out: those pages are the transport's, under /dev/shm, whoever maps them, and
stay mapped through a span, so the peak less them is the process's own.
"""

import re
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"  # see proc(5), /proc/pid/clear_refs


class PeakMemory:
    """The peak memory from construction to `gb()`: RSS on CPU, allocated memory on a GPU."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        else:
            _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
        self.device = device

    @property
    def metric(self) -> str:
        """The metric's name: what the figure measures."""
        return "max_memory_allocated_gb" if self.cuda else "peak_rss_gb"

    def gb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        status = _STATUS.read_text()
        peak, shared = (_kib(status, field) for field in ("VmHWM", "RssShmem"))
        return (peak - shared) * 1024 / 1e9


def _kib(status: str, field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1))
