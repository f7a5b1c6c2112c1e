"""Weight transport over Monarch RDMA buffers, any host: one read per version, no relay.

The publisher packs a version into one buffer of its own (the manifest's layout) and registers
it with Monarch RDMA; torchstore holds only the small parts, the buffer's handle and then the
manifest. A fetcher reads the whole buffer straight from the publisher's memory into its own
in one transfer: over ibverbs where the host has an RDMA NIC, else over Monarch's TCP fallback.
torchstore's own path, by contrast, moves each tensor into a storage volume and out again.

A deleted version's buffer stays registered until the publisher's next publish, which drops it
and packs the new version into it. A read that overlaps that (the version was deleted meanwhile)
is reported as WeightVersionGone, never as the new bytes: the fetcher checks that the version
still exists after its read, and a buffer is rewritten only after its version is gone.
"""

import asyncio
import warnings

import torch
from monarch.rdma import RDMABuffer, RDMATcpFallbackWarning

from forge.weights import torchstore_compat as ts
from forge.weights.manifest import (
    Manifest,
    WeightVersionError,
    WeightVersionGone,
    build_manifest,
    pack,
    unpack,
)
from forge.weights.torchstore_transport import TorchStoreTransport


class RdmaTransport(TorchStoreTransport):
    """Publishes versions as Monarch RDMA buffers; fetches read them in one transfer.

    Publish from an actor (a buffer belongs to its process's actor); call `ts.initialize`
    first, as for torchstore.
    """

    def __init__(self, prefix: str = "weights", fetch_timeout_s: float = 60.0) -> None:
        super().__init__(prefix, fetch_timeout_s)
        self._held: dict[int, tuple[torch.Tensor, RDMABuffer]] = {}  # published, by version
        self._spare: torch.Tensor | None = None  # a dropped version's buffer, for the next

    async def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> Manifest:
        """Packs `state_dict` into a registered buffer, then puts its handle and the manifest."""
        await self._drop_deleted()
        state_dict = {k: v.detach().cpu() for k, v in state_dict.items()}
        layout = build_manifest(version, state_dict, dict.fromkeys(state_dict, ""))
        packed = self._buffer(layout.total_bytes)
        checksums = await asyncio.to_thread(pack, packed, layout, state_dict, True)
        manifest = build_manifest(version, state_dict, checksums)
        with warnings.catch_warnings():
            # Expected without an RDMA NIC: the TCP fallback is the cross-host path then.
            warnings.simplefilter("ignore", RDMATcpFallbackWarning)
            handle = RDMABuffer(packed)
        self._held[version] = (packed, handle)
        await ts.put(self._key(version, "buffer"), handle)
        await ts.put(self._key(version, "manifest"), manifest.to_json())
        return manifest

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The spare buffer if it is big enough (its pages exist already), else a new one."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.numel() >= nbytes:
            return spare[:nbytes]
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)

    async def _drop_deleted(self) -> None:
        """Unregisters the buffers of versions deleted since; keeps one to write into."""
        alive = set(await self.versions())
        for version in [v for v in self._held if v not in alive]:
            packed, handle = self._held.pop(version)
            await handle.drop()
            self._spare = packed

    async def fetch_unverified(self, version: int) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """The version's manifest and its tensors, read in one transfer into a buffer of this
        process (views of it); not verified (see TorchStoreTransport.fetch_unverified)."""
        manifest = await self._manifest(version)
        try:
            handle = await ts.get(self._key(version, "buffer"))
        except KeyError:
            raise WeightVersionGone(f"version {version} was deleted while read") from None
        packed = torch.empty(max(manifest.total_bytes, 1), dtype=torch.uint8)
        try:
            await handle.read_into(packed, timeout=max(int(self.fetch_timeout_s), 1))
        except Exception as e:  # Monarch reports a failed transfer as its own error types
            await self._raise_if_gone(version)
            raise WeightVersionError(f"version {version}: RDMA read failed: {e}") from e
        await self._raise_if_gone(version)
        return manifest, unpack(packed.numpy(), manifest)

    async def _raise_if_gone(self, version: int) -> None:
        if not await ts.exists(self._key(version, "manifest")):
            raise WeightVersionGone(f"version {version} was deleted while it was read")

    async def delete(self, version: int) -> None:
        """Deletes the manifest (readers stop trusting the version), then the handle; the
        publisher drops the buffer at its next publish."""
        for part in ("manifest", "buffer"):
            if await ts.exists(self._key(version, part)):
                await ts.delete(self._key(version, part))
