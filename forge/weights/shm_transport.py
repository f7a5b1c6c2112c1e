"""Same-host weight transport: each version is one file of packed tensors in shared memory.

`/dev/shm/<root>/v<version>/tensors.bin` holds the tensors back to back; `manifest.json` is
renamed into place after it, so its presence means the version is complete. Readers map the
file copy-on-write: fetching costs no copy, only the checksum pass.

A deleted version's file is kept in `<root>/free/` and rewritten by the next publish: its pages
already exist, and writing into fresh tmpfs pages costs a page fault each (~5x slower than a
copy). Deleting a version therefore requires that no reader still maps it, which the contract
already asks (delete a version only once every generator has moved past it).
"""

import asyncio
import mmap
import os
import shutil
import time
import uuid
from pathlib import Path

import torch

from forge.weights.manifest import (
    Manifest,
    WeightVersionError,
    build_manifest,
    tensor_bytes,
    verify,
)


class SharedMemoryTransport:
    """Publishes and fetches weight versions through files under `root` (keep it on tmpfs)."""

    def __init__(self, root: str | Path, fetch_timeout_s: float = 60.0) -> None:
        self.root = Path(root)
        self.fetch_timeout_s = fetch_timeout_s

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:09d}"

    async def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> Manifest:
        """Packs `state_dict` into one file, then writes the manifest beside it."""
        return await asyncio.to_thread(self._publish, version, state_dict)

    def _publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> Manifest:
        state_dict = {k: v.detach().cpu() for k, v in state_dict.items()}
        manifest = build_manifest(version, state_dict)
        folder = self._dir(version)
        shutil.rmtree(folder, ignore_errors=True)  # a half-written earlier attempt
        folder.mkdir(parents=True)
        blob = folder / "tensors.bin"
        self._reuse_free_file(blob)
        with open(blob, "r+b" if blob.exists() else "wb+") as f:
            f.truncate(max(manifest.total_bytes, 1))
            with mmap.mmap(f.fileno(), 0) as mm:
                packed = torch.frombuffer(mm, dtype=torch.uint8)
                for e in manifest.tensors:
                    packed[e.offset : e.offset + e.nbytes].copy_(tensor_bytes(state_dict[e.name]))
                del packed  # the map cannot close while a view of it exists
        tmp = folder / "manifest.json.tmp"
        tmp.write_text(manifest.to_json())
        os.replace(tmp, folder / "manifest.json")
        return manifest

    def _reuse_free_file(self, blob: Path) -> None:
        for free in sorted((self.root / "free").glob("*.bin")):
            try:
                os.replace(free, blob)
                return
            except FileNotFoundError:
                continue  # another publisher took it

    async def fetch(self, version: int) -> dict[str, torch.Tensor]:
        """Maps the version's tensors (no copy) once its manifest exists, and verifies them."""
        manifest_path = await self._wait_for_manifest(version)
        return await asyncio.to_thread(self._read, version, manifest_path)

    async def fetch_packed(self, version: int) -> tuple[Path, Manifest]:
        """Verifies a version and returns its packed file and manifest, for a reader that maps
        the file itself (a vLLM engine process)."""
        manifest_path = await self._wait_for_manifest(version)
        await asyncio.to_thread(self._read, version, manifest_path)
        manifest = Manifest.from_json(manifest_path.read_text())
        return manifest_path.parent / "tensors.bin", manifest

    async def _wait_for_manifest(self, version: int) -> Path:
        manifest_path = self._dir(version) / "manifest.json"
        deadline = time.monotonic() + self.fetch_timeout_s
        while not manifest_path.exists():
            if time.monotonic() > deadline:
                raise WeightVersionError(
                    f"version {version}: no complete manifest at {manifest_path} "
                    f"after {self.fetch_timeout_s}s"
                )
            await asyncio.sleep(0.05)
        return manifest_path

    def _read(self, version: int, manifest_path: Path) -> dict[str, torch.Tensor]:
        manifest = Manifest.from_json(manifest_path.read_text())
        if manifest.version != version:
            raise WeightVersionError(f"version {version}: manifest is for {manifest.version}")
        with open(manifest_path.parent / "tensors.bin", "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < manifest.total_bytes:
                raise WeightVersionError(
                    f"version {version}: tensors.bin has {size} bytes, manifest says "
                    f"{manifest.total_bytes} (truncated)"
                )
            # Copy-on-write: torch needs a writable buffer, and nothing writes back to the file.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        state_dict = {}
        for e in manifest.tensors:
            flat = torch.frombuffer(mm, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
            state_dict[e.name] = flat.view(getattr(torch, e.dtype)).reshape(e.shape)
        verify(manifest, state_dict)
        return state_dict

    async def delete(self, version: int) -> None:
        """Removes the version; its file is kept for the next publish to write into."""
        await asyncio.to_thread(self._delete, version)

    def _delete(self, version: int) -> None:
        folder = self._dir(version)
        (folder / "manifest.json").unlink(missing_ok=True)  # readers stop trusting it first
        if (folder / "tensors.bin").exists():
            (self.root / "free").mkdir(exist_ok=True)
            os.replace(folder / "tensors.bin", self.root / "free" / f"{uuid.uuid4().hex}.bin")
        shutil.rmtree(folder, ignore_errors=True)

    async def clear(self) -> None:
        """Removes the whole root, free files included, and the parents it emptied (a root
        named after a run folder nests: /dev/shm/forge-runs/grpo)."""
        await asyncio.to_thread(self._clear)

    def _clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        for parent in self.root.parents:
            if os.path.ismount(parent):
                return
            try:
                parent.rmdir()
            except OSError:  # not empty: another run's, or not ours
                return

    async def versions(self) -> list[int]:
        """Versions with a manifest, oldest first."""
        if not self.root.exists():
            return []
        return sorted(
            int(d.name[1:]) for d in self.root.iterdir() if (d / "manifest.json").exists()
        )
