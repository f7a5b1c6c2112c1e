"""Starting actors from notebook cells that may run again.

A cell that spawns a service and is run twice would leave the first service's processes behind.
`replace(name, spawn)` stops what an earlier run of the cell started under `name` first:

    workers = await replace("workers", Worker.options(num_replicas=2).as_service())
    run = await replace("run", GRPO.start(cfg))  # anything with an async close() too

Processes do not outlive the kernel: Monarch's processes exit with the process that started
them, and vLLM engines with their generator.

A notebook's cells show forge's own lines, as the console does; `library_output_to(log)` sends
what vLLM, Monarch and torch print to a log file instead.
"""

import contextlib
import inspect
import logging
import os
import warnings
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TextIO, TypeVar

from forge.controller.provisioner import get_provisioner
from forge.controller.service import Service

T = TypeVar("T")

_started: dict[str, Any] = {}
_log: TextIO | None = None
_log_handler: logging.Handler | None = None


def library_output_to(log: str | Path) -> Path:
    """Sends what libraries print to `log` (appended) instead of the notebook's cells, and
    returns its absolute path.

    Libraries print in two ways. The actors' processes inherit this kernel's file descriptors
    1 and 2, and Monarch writes the output it forwards from them there too: ipykernel copies
    both into the running cell, so they are pointed at the log. In this process, Python
    warnings and the records of Python's logging go to the log as well (without a handler of
    its own, logging prints warnings to the cell: math-verify's, for one). `print` in the
    kernel (forge's lines, the notebook's own) keeps the cell: ipykernel's `sys.stdout` does
    not write to descriptor 1. What an actor prints goes to the log, with the libraries' lines
    of its process.
    """
    global _log
    log = Path(log).resolve()
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if _log is not None:
        _log.close()
    _log = open(log, "a", buffering=1)  # noqa: SIM115 -- open for the kernel's lifetime
    warnings.showwarning = _warning_to_log
    global _log_handler
    root = logging.getLogger()
    if _log_handler is not None:
        root.removeHandler(_log_handler)
    _log_handler = logging.StreamHandler(_log)
    root.addHandler(_log_handler)
    print(f"library output (vLLM, Monarch, torch) -> {log}")
    return log


def _warning_to_log(message, category, filename, lineno, file=None, line=None) -> None:
    _log.write(warnings.formatwarning(message, category, filename, lineno, line))


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
