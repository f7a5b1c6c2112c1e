"""Weight transport over torchstore: works across hosts (RDMA where available, else RPC).

Each tensor is stored under `<prefix>/v<version>/<name>`, and the manifest, as JSON, under
`<prefix>/v<version>/manifest` after all of them.
"""

import asyncio
import time

import torch

from forge.concurrency import all_or_none
from forge.weights import torchstore_compat as ts
from forge.weights.manifest import (
    Manifest,
    WeightVersionError,
    WeightVersionGone,
    build_manifest,
    verify,
)


class TorchStoreTransport:
    """Publishes and fetches weight versions through a torchstore (call `ts.initialize` first)."""

    def __init__(self, prefix: str = "weights", fetch_timeout_s: float = 60.0) -> None:
        self.prefix = prefix.strip("/")
        self.fetch_timeout_s = fetch_timeout_s

    def _key(self, version: int, name: str) -> str:
        return f"{self.prefix}/v{version:09d}/{name}"

    async def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> Manifest:
        """Puts every tensor, all at once (one by one waits out each call's round trip; those
        in flight hold at most a copy of the version), then the manifest."""
        state_dict = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
        manifest = await asyncio.to_thread(build_manifest, version, state_dict)
        await all_or_none(
            ts.put(self._key(version, f"tensors/{n}"), t) for n, t in state_dict.items()
        )
        await ts.put(self._key(version, "manifest"), manifest.to_json())
        return manifest

    async def fetch(self, version: int) -> dict[str, torch.Tensor]:
        """Waits for the manifest, gets every tensor it lists and verifies them."""
        manifest, state_dict = await self.fetch_unverified(version)
        await asyncio.to_thread(verify, manifest, state_dict)
        return state_dict

    async def fetch_unverified(self, version: int) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """The version's manifest and tensors, for a reader that verifies them where it uses
        them (a generator's engine), so the checksum pass is paid once.

        Raises WeightVersionGone at once if a newer version exists while this one's manifest
        does not (it was deleted), WeightVersionError if it does not appear in time.
        """
        manifest = await self._manifest(version)
        names = [e.name for e in manifest.tensors]
        try:
            tensors = await all_or_none(  # all at once, as `publish` puts them
                ts.get(self._key(version, f"tensors/{name}")) for name in names
            )
        except KeyError as e:
            raise WeightVersionGone(f"version {version} was deleted while read ({e})") from None
        return manifest, dict(zip(names, tensors, strict=True))

    async def _manifest(self, version: int) -> Manifest:
        """Waits for `version`'s manifest (see `fetch_unverified` for what is raised)."""
        key = self._key(version, "manifest")
        deadline = time.monotonic() + self.fetch_timeout_s
        while not await ts.exists(key):
            newer = [v for v in await self.versions() if v > version]
            if newer:
                raise WeightVersionGone(
                    f"version {version} was deleted or never completed (version {newer[-1]} "
                    "is newer)"
                )
            if time.monotonic() > deadline:
                raise WeightVersionError(
                    f"version {version}: no manifest in torchstore under {key!r} "
                    f"after {self.fetch_timeout_s}s"
                )
            await asyncio.sleep(0.05)
        try:
            return Manifest.from_json(await ts.get(key))
        except KeyError:
            raise WeightVersionGone(f"version {version} was deleted while read") from None

    async def delete(self, version: int) -> None:
        """Deletes the manifest first (so readers stop trusting the version), then tensors."""
        key = self._key(version, "manifest")
        if not await ts.exists(key):
            return
        manifest = Manifest.from_json(await ts.get(key))
        await ts.delete(key)
        for e in manifest.tensors:
            await ts.delete(self._key(version, f"tensors/{e.name}"))

    async def clear(self) -> None:
        """Deletes every version under the prefix."""
        for version in await self.versions():
            await self.delete(version)

    async def versions(self) -> list[int]:
        """Versions with a manifest, oldest first."""
        # torchstore 0.1.2's keys(prefix) matches nothing: filter the full list here.
        keys = [k for k in await ts.keys() if k.startswith(f"{self.prefix}/")]
        return sorted(int(k.split("/")[-2][1:]) for k in keys if k.endswith("/manifest"))
