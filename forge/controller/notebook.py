"""Starting actors from notebook cells that may run again.

A cell that spawns a service and is run twice would leave the first service's processes behind.
`replace(name, spawn)` stops what an earlier run of the cell started under `name` first:

    workers = await replace("workers", Worker.options(num_replicas=2).as_service())
    run = await replace("run", GRPO.start(cfg))  # anything with an async close() too

Processes do not outlive the kernel: Monarch's processes exit with the process that started
them, and vLLM engines with their generator.

A notebook's cells show forge's own lines, as the console does: what vLLM, Monarch and torch
print goes to a log file, named in the output of the cell that first starts actors
(forge/controller/library_output.py); `library_output_to(log)` picks the file.
"""

import contextlib
import inspect
from collections.abc import Awaitable
from typing import Any, TypeVar

# A notebook's import point for it, beside replace and stop.
from forge.controller.library_output import library_output_to as library_output_to
from forge.controller.provisioner import get_provisioner
from forge.controller.service import Service

T = TypeVar("T")

_started: dict[str, Any] = {}


async def replace(name: str, spawn: Awaitable[T]) -> T:
    """Stops what was started under `name` (if anything), then awaits `spawn` and keeps its
    result under `name`."""
    await stop(name)
    _started[name] = handle = await spawn
    return handle


async def stop(name: str) -> None:
    """Stops the service or actor started under `name`, or closes what its class gives an
    async `close()` (an app's run); nothing if there is none."""
    handle = _started.pop(name, None)
    if isinstance(handle, Service):
        await handle.shutdown()
    elif inspect.iscoroutinefunction(getattr(type(handle), "close", None)):
        await handle.close()
    elif handle is not None:
        with contextlib.suppress(ValueError):  # already stopped, by shutdown() for one
            await get_provisioner().stop_actor(handle)
