"""Workarounds for torchmonarch 0.7.0, each to drop once upstream fixes it."""

import asyncio
from typing import Any

# Monarch 0.7 raises this when a call's actor or process died; it is exported only from its
# private bindings. Import it from `forge.controller`.
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

__all__ = ["SupervisionError", "allow_slow_acks", "stop_proc_mesh"]

# Long enough for a live mesh's buffered log lines to arrive.
LOG_FLUSH_TIMEOUT_S = 3.0
# Monarch's wait for a message's acknowledgement, raised from its default of 30 s.
SLOW_ACK_TIMEOUT = "120s"


def allow_slow_acks() -> None:
    """Lets a process that is alive but starved (starting on cores other processes load)
    acknowledge a message late, instead of being reported dead.

    torchmonarch 0.7.0 reports a process whose acknowledgement takes over 30 s as crashed ("timeout
    waiting for message from proc mesh agent ... The process likely crashed"); `forge replay`'s
    trainer ranks, started on a busy machine, were so reported and then found alive when
    stopped. A process that exits is still reported at once, from its exit status. Call before
    spawning: the spawned processes take the setting with them.
    """
    from monarch.config import configure

    configure(message_delivery_timeout=SLOW_ACK_TIMEOUT)


async def stop_proc_mesh(mesh: Any) -> None:
    """`mesh.stop()`, which cannot hang on a mesh whose processes died.

    torchmonarch 0.7.0: in IPython (Jupyter), every proc mesh streams its logs to the client,
    and `ProcMesh.stop` first awaits a log flush with no deadline; a mesh whose process was
    killed never answers it, so stopping it (a service replacing a dead replica) hangs. The flush
    runs here with a deadline instead, and `stop` finds nothing left to flush.
    """
    manager = mesh._logging_manager
    if manager._logging_mesh_client is not None:
        try:
            await asyncio.wait_for(manager.flush_async(), LOG_FLUSH_TIMEOUT_S)
        except TimeoutError:
            pass
        manager._logging_mesh_client = None
    await mesh.stop()
