"""One thread for all of an actor's tensor compute, with the thread count its cores allow.

PyTorch's CPU kernels run on OpenMP (libgomp in the pip wheels), which gives every thread that
starts a parallel region a worker pool of its own. Once a process's pools hold more threads
than it has cores, libgomp's idle workers stop spinning after ~1000 iterations instead of
~300k, and every parallel region pays for waking them up. An actor that computes from
whichever thread `asyncio.to_thread` hands it soon has two pools, and its cores then idle in
every parallel region while the sleeping workers wake; with one compute thread they stay busy.
GOMP_SPINCOUNT does not lift the throttle.
"""

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class ComputeThread:
    """Runs functions one at a time on the same thread, which uses `threads` threads.

    `threads` may change between calls (the actor moved onto other cores): the compute
    thread resizes its own pool before the next call, as only the thread that owns a pool can.
    """

    def __init__(self, name: str) -> None:
        self.threads = torch.get_num_threads()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the compute thread, awaited without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(self._sized, fn, *args))

    def _sized(self, fn: Callable[..., T], *args: Any) -> T:
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return fn(*args)
