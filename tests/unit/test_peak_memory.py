"""PeakMemory on CPU: the process's own peak, without the shared memory it maps.

Measured in a fresh process: in a test worker, memory earlier tests freed but the allocator
kept can serve the private allocation without raising the process's resident set."""

import json
import subprocess
import sys

MEASURE = """
import json, mmap, os
import numpy as np
from forge.observability.memory import PeakMemory

MB = 1 << 20
path = f"/dev/shm/forge-test-peak-{os.getpid()}"
with open(path, "wb+") as f:
    f.truncate(256 * MB)
    shared = mmap.mmap(f.fileno(), 256 * MB)
os.unlink(path)
peak = PeakMemory()
before = peak.gb()
np.frombuffer(shared, dtype=np.uint8)[:] = 1  # every page resident, in this process
after_shared = peak.gb()
private = np.ones(256 * MB, dtype=np.uint8)
print(json.dumps({"shared": after_shared - before, "private": peak.gb() - before}))
"""


def test_private_memory_counts_and_mapped_shared_memory_does_not():
    out = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    grew = json.loads(out.stdout)
    assert grew["shared"] < 0.05, grew
    assert grew["private"] > 0.25, grew
