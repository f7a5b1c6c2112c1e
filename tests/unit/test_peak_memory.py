"""PeakMemory on CPU: the process's own peak, without the shared memory it maps."""

import mmap
import os

import numpy as np

from forge.observability.memory import PeakMemory

MB = 1 << 20


def test_private_memory_counts_and_mapped_shared_memory_does_not(tmp_path):
    path = f"/dev/shm/forge-test-peak-{os.getpid()}"
    with open(path, "wb+") as f:
        f.truncate(256 * MB)
        shared = mmap.mmap(f.fileno(), 256 * MB)
    os.unlink(path)
    try:
        peak = PeakMemory()
        before = peak.gb()  # the process so far
        np.frombuffer(shared, dtype=np.uint8)[:] = 1  # every page resident, in this process
        assert peak.gb() - before < 0.05
        private = np.ones(256 * MB, dtype=np.uint8)
        assert peak.gb() - before > 0.25
        del private
    finally:
        shared.close()
