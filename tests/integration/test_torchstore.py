"""torchstore through forge's compatibility shim, with real Monarch processes.

A store (one storage-volume process) is started once for the module; two more processes host
``StoreUser`` actors. Tensors and state dicts go actor -> driver, actor -> actor (different
processes) and driver -> actor, and must come back bit-exact with their dtypes. Weight versions
go through both cross-host transports: torchstore's own, and Monarch RDMA buffers (over
Monarch's TCP fallback here: no RDMA NIC) with torchstore holding the manifests.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import cloudpickle
import pytest
import torch
from monarch.actor import Actor, ActorError, ProcMesh, endpoint, this_host

from forge.weights import torchstore_compat as tsc
from forge.weights.manifest import WeightVersionError
from forge.weights.rdma_transport import RdmaTransport
from forge.weights.torchstore_transport import TorchStoreTransport
from forge.weights.transport import delete_older_than

pytestmark = pytest.mark.integration

# Every await on the store or an actor gets this deadline: a failure must not hang the test.
DEADLINE_S = 60.0

# pytest imports this file under a name the child processes cannot import; ship the actor
# class to them by value instead.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make_tensor() -> torch.Tensor:
    """A deterministic 2-D float32 tensor."""
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7


def make_state_dict(seed: int) -> dict[str, Any]:
    """A small nested state dict of mixed dtypes, the same for the same ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": {"weight": torch.randn(5, 3, generator=g)},
        "layers": {
            "0": {
                "attn": {"q": torch.randn(3, 3, generator=g).to(torch.bfloat16)},
                "norm": torch.randn(3, generator=g).to(torch.float16),
            },
            "1": {"mlp": torch.randn(2, 3, generator=g, dtype=torch.float64)},
        },
        "step": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.randint(0, 255, (4,), generator=g, dtype=torch.uint8),
    }


def assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """Assert two nested dicts of tensors are equal: same keys, dtypes, shapes and bits."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {type(actual)}"
        assert actual.keys() == expected.keys(), f"{path}: keys differ"
        for k in expected:
            assert_same(actual[k], expected[k], f"{path}/{k}")
        return
    assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual)}"
    assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
    assert torch.equal(actual, expected), f"{path}: values differ"


async def deadline(awaitable: Any) -> Any:
    """Await ``awaitable`` with the test deadline."""
    return await asyncio.wait_for(awaitable, timeout=DEADLINE_S)


class StoreUser(Actor):
    """Puts and gets through torchstore from its own process."""

    @endpoint
    async def put_tensor(self, key: str) -> None:
        """Put :func:`make_tensor` under ``key``."""
        await tsc.put(key, make_tensor())

    @endpoint
    async def put_state_dict(self, key: str, seed: int) -> None:
        """Put ``make_state_dict(seed)`` under ``key``."""
        await tsc.put_state_dict(make_state_dict(seed), key)

    @endpoint
    async def publish(self, prefix: str, version: int) -> int:
        """Publish a flat HF-style state dict as a weight version; returns its byte count."""
        transport = TorchStoreTransport(prefix)
        return (await transport.publish(version, versioned_state_dict(version))).total_bytes

    @endpoint
    async def publish_rdma(self, prefix: str, version: int) -> int:
        """Publish `version` as an RDMA buffer (one transport per actor, as a trainer holds);
        returns how many buffers this publisher still holds registered."""
        if not hasattr(self, "rdma"):
            self.rdma = RdmaTransport(prefix)
        await self.rdma.publish(version, versioned_state_dict(version))
        return len(self.rdma._held)

    @endpoint
    async def corrupt_rdma(self, version: int) -> None:
        """Flip one byte of a published version's buffer, after its manifest was written."""
        packed, _ = self.rdma._held[version]
        packed[0] ^= 0xFF

    @endpoint
    async def fetch_rdma(self, prefix: str, version: int) -> dict[str, torch.Tensor]:
        """Fetch and verify `version` over RDMA from this process."""
        return await RdmaTransport(prefix, fetch_timeout_s=1.0).fetch(version)

    @endpoint
    async def get_tensor(self, key: str) -> torch.Tensor:
        """Get the tensor stored under ``key``."""
        return await tsc.get(key)

    @endpoint
    async def get_state_dict(self, key: str) -> dict[str, Any]:
        """Get the state dict stored under ``key``."""
        return await tsc.get_state_dict(key)


@pytest.fixture(scope="module")
async def store() -> AsyncIterator[None]:
    """One torchstore store for the module, shut down (volume process stopped) at the end."""
    await deadline(tsc.initialize(num_storage_volumes=1))
    try:
        yield
    finally:
        await deadline(tsc.shutdown())


@pytest.fixture(scope="module")
async def users(store: None) -> AsyncIterator[StoreUser]:
    """``StoreUser`` actors in two processes of their own, stopped at the end."""
    procs: ProcMesh = this_host().spawn_procs(per_host={"procs": 2})
    try:
        yield procs.spawn("store_user", StoreUser)
    finally:
        await deadline(procs.stop())


async def test_actor_put_driver_get(users: StoreUser) -> None:
    writer = users.slice(procs=0)
    await deadline(writer.put_tensor.call_one("a2d/tensor"))
    await deadline(writer.put_state_dict.call_one("a2d/sd", 1))

    assert_same(await deadline(tsc.get("a2d/tensor")), make_tensor())
    assert_same(await deadline(tsc.get_state_dict("a2d/sd")), make_state_dict(1))
    assert await deadline(tsc.exists("a2d/tensor"))


async def test_actor_put_other_process_get(users: StoreUser) -> None:
    writer, reader = users.slice(procs=0), users.slice(procs=1)
    await deadline(writer.put_tensor.call_one("a2a/tensor"))
    await deadline(writer.put_state_dict.call_one("a2a/sd", 2))

    assert_same(await deadline(reader.get_tensor.call_one("a2a/tensor")), make_tensor())
    assert_same(await deadline(reader.get_state_dict.call_one("a2a/sd")), make_state_dict(2))


async def test_driver_put_actor_get(users: StoreUser) -> None:
    await deadline(tsc.put_state_dict(make_state_dict(3), "d2a/sd"))
    reader = users.slice(procs=1)
    assert_same(await deadline(reader.get_state_dict.call_one("d2a/sd")), make_state_dict(3))


async def test_overwrite_returns_latest(store: None) -> None:
    await deadline(tsc.put("overwrite", torch.zeros(3)))
    await deadline(tsc.put("overwrite", torch.ones(3, dtype=torch.float64)))
    assert_same(await deadline(tsc.get("overwrite")), torch.ones(3, dtype=torch.float64))


async def test_missing_key_raises_clearly(store: None) -> None:
    assert not await deadline(tsc.exists("never-put"))
    with pytest.raises(KeyError, match="Unable to locate never-put"):
        await deadline(tsc.get("never-put"))
    with pytest.raises(RuntimeError, match="Mapping is missing"):
        await deadline(tsc.get_state_dict("never-put-sd"))
    # The controller survives the failed lookups.
    await deadline(tsc.put("after-miss", torch.arange(3)))
    assert_same(await deadline(tsc.get("after-miss")), torch.arange(3))


def versioned_state_dict(version: int) -> dict[str, torch.Tensor]:
    """A flat HF-style state dict of mixed dtypes, different per version."""
    return {f"w{i}": t for i, t in enumerate(_leaves(make_state_dict(version)))}


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    return [tree]


async def test_weight_versions_over_torchstore(users: StoreUser) -> None:
    transport = TorchStoreTransport("weights-test", fetch_timeout_s=1.0)
    publisher = users.slice(procs=0)
    for version in (1, 2):
        assert await deadline(publisher.publish.call_one("weights-test", version)) > 0
    assert_same(await deadline(transport.fetch(2)), versioned_state_dict(2))
    assert await deadline(transport.versions()) == [1, 2]

    # One tensor overwritten after the manifest was written: the fetch refuses the version.
    await deadline(tsc.put(transport._key(2, "tensors/w0"), torch.zeros(5, 3)))
    with pytest.raises(WeightVersionError, match="checksum mismatch in w0"):
        await deadline(transport.fetch(2))
    with pytest.raises(WeightVersionError, match="version 9: no manifest"):
        await deadline(transport.fetch(9))

    assert await deadline(delete_older_than(transport, 2)) == [1]
    assert await deadline(transport.versions()) == [2]
    await deadline(transport.clear())
    assert await deadline(transport.versions()) == []
    assert not [k for k in await deadline(tsc.keys()) if k.startswith("weights-test/")]


async def test_weight_versions_over_rdma_buffers(users: StoreUser) -> None:
    prefix, transport = "weights-rdma", RdmaTransport("weights-rdma")
    publisher, reader = users.slice(procs=0), users.slice(procs=1)
    assert await deadline(publisher.publish_rdma.call_one(prefix, 1)) == 1
    assert await deadline(publisher.publish_rdma.call_one(prefix, 2)) == 2
    for version in (1, 2):  # read from the publisher's memory by another process, verified
        fetched = await deadline(reader.fetch_rdma.call_one(prefix, version))
        assert_same(fetched, versioned_state_dict(version))
    assert await deadline(transport.versions()) == [1, 2]

    # A deleted version is gone for readers at once; its buffer is dropped, and written into,
    # by the publisher's next publish: two buffers at most, however many versions.
    assert await deadline(delete_older_than(transport, 2)) == [1]
    with pytest.raises(ActorError, match="WeightVersionGone: version 1 was deleted"):
        await deadline(reader.fetch_rdma.call_one(prefix, 1))
    assert await deadline(publisher.publish_rdma.call_one(prefix, 3)) == 2
    assert_same(await deadline(reader.fetch_rdma.call_one(prefix, 3)), versioned_state_dict(3))

    # Bytes changed after the manifest was written: the reader refuses the version.
    await deadline(publisher.corrupt_rdma.call_one(3))
    with pytest.raises(ActorError, match="WeightVersionError: .*checksum mismatch in w0"):
        await deadline(reader.fetch_rdma.call_one(prefix, 3))
    with pytest.raises(ActorError, match="WeightVersionError: version 9: no manifest"):
        await deadline(reader.fetch_rdma.call_one(prefix, 9))

    await deadline(transport.clear())
    assert not [k for k in await deadline(tsc.keys()) if k.startswith(f"{prefix}/")]


def test_shim_is_installed_once() -> None:
    import torchstore.api

    before = torchstore.api.Controller
    tsc.apply_compat()
    assert torchstore.api.Controller is before is tsc.AsyncController
