"""Make torchstore 0.1.2 usable on torchmonarch 0.7.0.

Works around these upstream versions: **torchstore 0.1.2** (the only release on PyPI, written for
torchmonarch 0.1.x) running on **torchmonarch 0.7.0**. Remove this module once a torchstore
release supports Monarch 0.7.

What is worked around:

1. Monarch 0.7 refuses to spawn an actor class whose endpoints mix ``def`` and ``async def``
   (``ValueError: ... mixes both async and sync endpoints``). torchstore's ``Controller`` has five
   sync endpoints (``get_controller_strategy``, ``keys``, ``locate_volumes``, ``notify_put``,
   ``notify_delete``) next to two async ones (``init``, ``teardown``), so stock
   ``torchstore.initialize()`` fails. :class:`AsyncController` re-declares the five as
   ``async def`` endpoints that call the upstream method bodies unchanged, and
   ``torchstore.api.Controller`` (the name torchstore spawns its controller from) is pointed at
   it. The upstream bodies never await, so running them on the actor's event loop is safe.
2. torchstore probes RDMA with Monarch's deprecated ``is_rdma_available()``, which warns with a
   ``DeprecationWarning`` on every put and get. It is swapped for ``is_ibverbs_available()``,
   which Monarch documents as its exact equivalent. Behaviour is unchanged: without InfiniBand,
   torchstore moves tensors over Monarch RPC (Monarch's own TCP RDMA fallback is not used).
3. With no ``mesh``, ``torchstore.initialize()`` spawns a proc mesh for its storage volumes that
   ``torchstore.shutdown()`` never stops. :func:`initialize` spawns that mesh itself and
   :func:`shutdown` stops it, so no processes are left behind. A store is also registered with
   forge's provisioner, so ``forge.controller.shutdown()`` shuts it down with everything else.

The patches are applied once, idempotently, when this module is imported. Any process that
receives a handle to the controller imports this module (the handle names
:class:`AsyncController` by module path), so actors in other processes are patched too; forge
code should still import put/get from here rather than from torchstore directly.
"""

from __future__ import annotations

from typing import Any

import monarch.rdma
import torchstore  # noqa: F401  (importing it sets HYPERACTOR_CODEC_MAX_FRAME_LENGTH)
import torchstore.api as _ts_api
import torchstore.transport.buffers as _ts_buffers
from monarch.actor import ProcMesh, endpoint, this_host
from torchstore.api import (
    DEFAULT_TORCHSTORE_NAME,
    delete,
    exists,
    get,
    get_state_dict,
    keys,
    put,
    put_state_dict,
)
from torchstore.controller import Controller as _UpstreamController
from torchstore.controller import StorageInfo
from torchstore.strategy import TorchStoreStrategy
from torchstore.transport.pipe import Request

from forge.controller import Provisioner, get_provisioner

__all__ = [
    "DEFAULT_TORCHSTORE_NAME",
    "AsyncController",
    "apply_compat",
    "delete",
    "exists",
    "get",
    "get_state_dict",
    "initialize",
    "keys",
    "put",
    "put_state_dict",
    "shutdown",
]

# The five endpoints that are plain ``def`` upstream.
_SYNC_ENDPOINTS = (
    "get_controller_strategy",
    "keys",
    "locate_volumes",
    "notify_put",
    "notify_delete",
)


def _upstream(name: str) -> Any:
    """The undecorated upstream method behind the Controller endpoint ``name``."""
    return getattr(_UpstreamController, name)._method


class AsyncController(_UpstreamController):
    """torchstore's Controller with every endpoint ``async``, as Monarch 0.7 requires.

    Each endpoint calls the upstream method body unchanged; only the endpoint kind differs.
    """

    @endpoint
    async def get_controller_strategy(self) -> TorchStoreStrategy:
        """Return the strategy the store was initialized with."""
        return _upstream("get_controller_strategy")(self)

    @endpoint
    async def keys(self, prefix: str | None = None) -> list[str]:
        """Return the stored keys, optionally only those starting with ``prefix``."""
        return _upstream("keys")(self, prefix)

    @endpoint
    async def locate_volumes(self, key: str) -> dict[str, StorageInfo]:
        """Return ``{storage_volume_id: StorageInfo}`` for ``key``; ``KeyError`` if absent."""
        return _upstream("locate_volumes")(self, key)

    @endpoint
    async def notify_put(self, key: str, request: Request, storage_volume_id: str) -> None:
        """Record that ``key`` was stored in ``storage_volume_id``."""
        return _upstream("notify_put")(self, key, request, storage_volume_id)

    @endpoint
    async def notify_delete(self, key: str, storage_volume_id: str) -> None:
        """Record that ``key`` is being deleted from ``storage_volume_id``."""
        return _upstream("notify_delete")(self, key, storage_volume_id)


def apply_compat() -> None:
    """Install the workarounds into torchstore in this process. Idempotent.

    Called when this module is imported; calling it again does nothing.
    """
    _ts_api.Controller = AsyncController
    _ts_buffers.monarch_rdma_available = monarch.rdma.is_ibverbs_available


apply_compat()

# Proc meshes spawned by :func:`initialize` for storage volumes, by store name.
_volume_meshes: dict[str, ProcMesh] = {}


class _Store:
    """A store initialized here, owned by the provisioner so that its shutdown stops it."""

    def __init__(self, name: str, provisioner: Provisioner) -> None:
        self.name = name
        self.provisioner = provisioner

    async def shutdown(self) -> None:
        await shutdown(self.name)


# Stores initialized by this process, by name.
_stores: dict[str, _Store] = {}


async def initialize(
    num_storage_volumes: int = 1,
    strategy: TorchStoreStrategy | None = None,
    store_name: str = DEFAULT_TORCHSTORE_NAME,
    mesh: ProcMesh | None = None,
) -> None:
    """Start a torchstore store: its controller and ``num_storage_volumes`` storage volumes.

    Same arguments as ``torchstore.initialize``. With ``mesh=None`` the storage volumes run in a
    new proc mesh on this host (one process per volume), which :func:`shutdown` stops.
    Storage volume actors are spawned on ``mesh`` otherwise, and the caller owns it. The store
    is shut down by :func:`shutdown` or, at the latest, by ``forge.controller.shutdown()``.

    Raises:
        RuntimeError: if this process already initialized ``store_name`` with ``mesh=None``, or
            if ``num_storage_volumes > 1`` and no ``strategy`` is given. (A store initialized
            some other way is rejected by its controller, as a Monarch ``ActorError``.)
    """
    if mesh is None:
        if store_name in _volume_meshes:
            raise RuntimeError(f"torchstore store {store_name!r} is already initialized")
        mesh = this_host().spawn_procs(
            per_host={"procs": num_storage_volumes}, name=f"torchstore_{store_name}"
        )
        _volume_meshes[store_name] = mesh
    try:
        await _ts_api.initialize(
            num_storage_volumes=num_storage_volumes,
            strategy=strategy,
            store_name=store_name,
            mesh=mesh,
        )
    except BaseException:
        owned = _volume_meshes.pop(store_name, None)
        if owned is not None:
            await owned.stop()
        raise
    store = _stores[store_name] = _Store(store_name, get_provisioner())
    store.provisioner.own(store)


async def shutdown(store_name: str = DEFAULT_TORCHSTORE_NAME) -> None:
    """Tear down the store ``store_name`` and stop the storage-volume processes it spawned.

    Only this process's cached torchstore client is dropped; other processes that used the
    store must not use it again before a new :func:`initialize`. Does nothing for a store this
    process did not initialize, or shut down already (upstream would spawn a new controller).
    """
    store = _stores.pop(store_name, None)
    if store is None:
        return
    store.provisioner.disown(store)
    try:
        await _ts_api.shutdown(store_name)
    finally:
        owned = _volume_meshes.pop(store_name, None)
        if owned is not None:
            await owned.stop()
