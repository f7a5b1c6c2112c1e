"""Workarounds for torchmonarch 0.7.0, each to drop once upstream fixes it."""

import asyncio
from typing import Any

# Monarch 0.7 raises this when a call's actor or process died; it is exported only from its
# private bindings. Import it from `forge.controller`.
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

__all__ = ["SupervisionError", "stop_proc_mesh", "tolerate_starved_processes"]

# Long enough for a live mesh's buffered log lines to arrive.
LOG_FLUSH_TIMEOUT_S = 3.0
# How long a live process may go without answering Monarch before it is reported dead; the
# defaults of torchmonarch 0.7.0 are 30 s.
STARVED_TIMEOUT = "2m"
# Monarch refuses a supervision watchdog shorter than its poll interval (10 s) plus the actor
# and proc state waits (STARVED_TIMEOUT, 1 min).
WATCHDOG_TIMEOUT = "4m"
# A process that has not heard from its controller for this long stops itself ("stopped:
# orphaned"); the controller's keepalives ride on its state queries, which may now wait
# STARVED_TIMEOUT. Processes whose controller died end sooner, with it (parent-death signal).
ORPHAN_TIMEOUT = "5m"


def tolerate_starved_processes() -> None:
    """Lets a process that is alive but starved (starting or computing on cores that other
    processes load) answer Monarch late, instead of being reported dead.

    torchmonarch 0.7.0 reports a process that does not answer a state query within 30 s
    ("timeout waiting for message from proc mesh agent ... The process likely crashed") or
    acknowledge a message within 30 s as failed. On a loaded machine live processes were so
    reported: a generator importing vLLM, trainer ranks being pinned; the run then failed
    while they were still working. A process that exits is still reported at once, from its
    exit status; only a process that hangs, or a host that vanishes, is noticed later. A
    process stops itself as orphaned only after ORPHAN_TIMEOUT without its controller.
    Called by each Provisioner before it spawns: spawned processes take the settings with them.
    """
    from monarch.config import configure

    configure(
        message_delivery_timeout=STARVED_TIMEOUT,
        get_actor_state_max_idle=STARVED_TIMEOUT,
        actor_spawn_max_idle=STARVED_TIMEOUT,
        mesh_proc_spawn_max_idle=STARVED_TIMEOUT,
        supervision_watchdog_timeout=WATCHDOG_TIMEOUT,
        mesh_orphan_timeout=ORPHAN_TIMEOUT,
    )


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
