"""Workarounds for torchmonarch 0.7.0, each to drop once upstream fixes it."""

import asyncio
from typing import Any

# Monarch 0.7 raises this when a call's actor or process died; it is exported only from its
# private bindings. Import it from `forge.controller`.
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

__all__ = ["SupervisionError", "stop_proc_mesh"]

# Long enough for a live mesh's buffered log lines to arrive.
LOG_FLUSH_TIMEOUT_S = 3.0


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
