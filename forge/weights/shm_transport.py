"""Same-host weight transport: each version is one file of packed tensors in shared memory.

`<root>/v<version>/tensors.bin` holds the tensors back to back; `manifest.json` is renamed into
place after it, so its presence means the version is complete.

A deleted version's file is kept in `<root>/free/` and rewritten by the next publish: its pages
already exist, and writing into fresh tmpfs pages costs a page fault each (several times a
copy's cost). The publisher keeps its mapping of each file it wrote while the file is in use, so
that a version is a plain memory copy: `pwrite` into tmpfs costs a page-cache lookup per 4 KiB
page and serialises on the file's lock, so it does not speed up with more threads, where copies
from several threads into the kept mapping do. So that verified bytes can never change under a
reader, readers hold a shared `flock` on the file from before they verify the bytes until they
no longer map them, and a publisher rewrites a free file only if it gets the exclusive lock at
once, else it writes a fresh file.
A generator pins a version (`pin`: the lock, and a path to that very file), and its vLLM engine
verifies and loads it on one mapping of that file (`open_version`). A reader that finds its
version deleted, or asks for one when a newer version exists, gets WeightVersionGone at once.
"""

import asyncio
import fcntl
import mmap
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import numpy as np
import torch

from forge.weights.manifest import (
    Manifest,
    TensorEntry,
    WeightVersionError,
    WeightVersionGone,
    build_manifest,
    checksum,
    tensor_bytes,
    unpack,
    verify,
)

# Spare files kept for reuse: one covers the steady state (a version is deleted after the next
# is published); more would hold a model's worth of RAM each for nothing.
MAX_FREE_FILES = 1


class SharedMemoryTransport:
    """Publishes and fetches weight versions through files under `root` (keep it on tmpfs).

    `root` None: a transport nobody gave a folder (a run gives its actors one); it fails on use.
    """

    def __init__(self, root: str | Path | None, fetch_timeout_s: float = 60.0) -> None:
        self._root = None if root is None else Path(root)
        self.fetch_timeout_s = fetch_timeout_s
        # (dev, inode, size) of a file this process published into -> its kept mapping
        self._mapped: dict[tuple[int, int, int], mmap.mmap] = {}

    @property
    def root(self) -> Path:
        if self._root is None:
            raise ValueError(
                "the shm weight transport has no path: set weight_sync.transport.path, or start "
                "the actors from a Run, which gives them its shared-memory folder"
            )
        return self._root

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:09d}"

    async def publish(
        self, version: int, state_dict: dict[str, torch.Tensor], manifest: Manifest | None = None
    ) -> Manifest:
        """Packs `state_dict` into one file, then writes the manifest beside it.

        `manifest`: a description of `state_dict` already at hand (the one it was fetched with
        elsewhere), written as is without recomputing checksums; readers verify against it.
        """
        return await asyncio.to_thread(self._publish, version, state_dict, manifest)

    def _publish(
        self, version: int, state_dict: dict[str, torch.Tensor], manifest: Manifest | None
    ) -> Manifest:
        state_dict = {k: v.detach().cpu() for k, v in state_dict.items()}
        given = manifest
        layout = given or build_manifest(version, state_dict, dict.fromkeys(state_dict, ""))
        if layout.version != version:
            raise ValueError(f"publishing version {version} with the manifest of {layout.version}")
        folder = self._dir(version)
        shutil.rmtree(folder, ignore_errors=True)  # a half-written earlier attempt
        folder.mkdir(parents=True)
        with self._file_to_write(folder / "tensors.bin") as f:
            f.truncate(max(layout.total_bytes, 1))
            checksums = _write(self._mapping(f), layout, state_dict, checksum_too=given is None)
        manifest = given or build_manifest(version, state_dict, checksums)
        tmp = folder / "manifest.json.tmp"
        tmp.write_text(manifest.to_json())
        os.replace(tmp, folder / "manifest.json")
        return manifest

    @contextmanager
    def _file_to_write(self, blob: Path) -> Iterator[IO[bytes]]:
        """A free file moved to `blob` under an exclusive lock, or a fresh file if every free
        one is still mapped by a reader (or there is none)."""
        for free in sorted((self.root / "free").glob("*.bin")):
            try:
                f = open(free, "r+b")
            except FileNotFoundError:
                continue  # another publisher took it
            with f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.replace(free, blob)
                except BlockingIOError:
                    continue  # a reader still maps it: its bytes must not change
                except FileNotFoundError:
                    continue  # another publisher took it between our open and our lock
                yield f
                return
        with open(blob, "wb+") as f:
            yield f

    def _mapping(self, f: IO[bytes]) -> mmap.mmap:
        """This process's writable mapping of `f`, made once per file and kept while the file
        is a version's or a free one; mappings of files gone since are dropped here, so the
        memory of a deleted file is given back."""
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size)
        live = {_inode(p) for p in self.root.glob("*/*.bin")}
        for old in [k for k in self._mapped if k != key and k[:2] not in live]:
            _unmap(self._mapped.pop(old))
        if key not in self._mapped:
            # Mapped through an open of its own: mmap keeps a duplicate of the descriptor it is
            # given, and one of `f` would keep `f`'s exclusive lock, and every reader out, for
            # as long as the mapping is kept.
            fd = os.open(f"/proc/self/fd/{f.fileno()}", os.O_RDWR)
            try:
                self._mapped[key] = mmap.mmap(fd, st.st_size, flags=_SHARED_POPULATED)
            finally:
                os.close(fd)
        return self._mapped[key]

    def _unmap_all(self) -> None:
        for mm in self._mapped.values():
            _unmap(mm)
        self._mapped.clear()

    async def locate(self, version: int) -> tuple[Path, Manifest]:
        """Waits for `version`'s manifest; returns the version's folder and its manifest.

        Nothing is verified here: the reader verifies the bytes where it maps them
        (`open_version`), so the checksum pass is paid once. Raises WeightVersionGone at once
        if a newer version exists meanwhile, WeightVersionError after `fetch_timeout_s`.
        """
        manifest_path = self._dir(version) / "manifest.json"
        deadline = time.monotonic() + self.fetch_timeout_s
        while True:
            try:
                manifest = Manifest.from_json(manifest_path.read_text())
                break
            except FileNotFoundError:
                pass
            newer = [v for v in self._versions() if v > version]
            if newer:
                raise WeightVersionGone(
                    f"version {version} was deleted or never completed (version {newer[-1]} "
                    "is newer)"
                )
            if time.monotonic() > deadline:
                raise WeightVersionError(
                    f"version {version}: no complete manifest at {manifest_path} "
                    f"after {self.fetch_timeout_s}s"
                )
            await asyncio.sleep(0.05)
        if manifest.version != version:
            raise WeightVersionError(f"version {version}: manifest is for {manifest.version}")
        return manifest_path.parent, manifest

    async def fetch(self, version: int) -> dict[str, torch.Tensor]:
        """A verified private copy of the version's tensors, once its manifest exists."""
        folder, manifest = await self.locate(version)
        return await asyncio.to_thread(_read_copy, folder, manifest)

    async def delete(self, version: int) -> None:
        """Removes the version; its file is kept for the next publish to write into."""
        await asyncio.to_thread(self._delete, version)

    def _delete(self, version: int) -> None:
        folder = self._dir(version)
        (folder / "manifest.json").unlink(missing_ok=True)  # readers stop trusting it first
        blob, free = folder / "tensors.bin", self.root / "free"
        if blob.exists() and len(list(free.glob("*.bin"))) < MAX_FREE_FILES:
            free.mkdir(exist_ok=True)
            os.replace(blob, free / f"{uuid.uuid4().hex}.bin")
        shutil.rmtree(folder, ignore_errors=True)  # readers that map its file keep it alive

    async def clear(self) -> None:
        """Removes the whole root, free files included, and the parents it emptied."""
        await asyncio.to_thread(self._clear)

    def _clear(self) -> None:
        self._unmap_all()
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
        return self._versions()

    def _versions(self) -> list[int]:
        if not self.root.exists():
            return []
        return sorted(
            int(d.name[1:]) for d in self.root.iterdir() if (d / "manifest.json").exists()
        )


@contextmanager
def pin(folder: str | Path, expected: Manifest) -> Iterator[Path]:
    """Pins the version in `folder`: until the block ends its file can be neither rewritten
    nor lost, even if the version is deleted meanwhile.

    Yields a path to that very file (`/proc/<pid>/fd/<n>`) that other processes of this host,
    such as a vLLM engine and its workers, open to map it (`open_version`). Raises
    WeightVersionGone if the version was deleted already.
    """
    with _locked(Path(folder), expected) as f:
        yield Path(f"/proc/{os.getpid()}/fd/{f.fileno()}")


@contextmanager
def open_version(path: str | Path, expected: Manifest) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors in the packed file at `path` (from `pin`), as read-only views of one
    mapping, verified against `expected`.

    The mapping holds a shared lock, so publishers leave the bytes alone while anyone can read
    them; it is released when the block ends (the dict is emptied then). Raises
    WeightVersionError if the bytes are not what `expected` describes.
    """
    with open(path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        _check_size(f, expected)
        mm = mmap.mmap(f.fileno(), 0, flags=_SHARED_POPULATED, prot=mmap.PROT_READ)
    # mmap holds its own duplicate of the descriptor, hence of the lock: both live as long as
    # the mapping.
    tensors = unpack(mm, expected)
    try:
        verify(expected, tensors)
        yield tensors
    finally:
        tensors.clear()
        _unmap(mm)  # if the caller kept a view, mapping and lock go when it is freed


# Page tables filled in one call when a file is mapped: a fault per 4 KiB page on first touch
# costs more than copying the page.
_SHARED_POPULATED = mmap.MAP_SHARED | mmap.MAP_POPULATE


def _write(
    mm: mmap.mmap, layout: Manifest, state_dict: dict[str, torch.Tensor], checksum_too: bool
) -> dict[str, str]:
    """Copies each tensor to its offset in the mapped file `mm`, from as many threads as this
    process has cores for compute (numpy copies without the GIL, and without a second OpenMP
    pool in this process); checksums each tensor's bytes as they go if `checksum_too`."""
    file = np.frombuffer(mm, dtype=np.uint8)
    threads = max(torch.get_num_threads(), 1)
    shares: list[list[TensorEntry]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for e in sorted(layout.tensors, key=lambda e: -e.nbytes):  # largest first: even shares
        least = loads.index(min(loads))
        shares[least].append(e)
        loads[least] += e.nbytes

    def write_share(share: list[TensorEntry]) -> dict[str, str]:
        written = {}
        for e in share:
            data = tensor_bytes(state_dict[e.name])  # any dtype, as contiguous uint8
            np.copyto(file[e.offset : e.offset + e.nbytes], data.numpy())
            written[e.name] = checksum(data) if checksum_too else ""
        return written

    with ThreadPoolExecutor(threads) as pool:
        return {k: v for done in pool.map(write_share, shares) for k, v in done.items()}


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _unmap(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive: the mapping goes when it is freed


def _read_copy(folder: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    """A private copy of the version's bytes, read under the lock and verified."""
    packed = torch.empty(max(manifest.total_bytes, 1), dtype=torch.uint8)
    with _locked(folder, manifest) as f:
        read = f.readinto(packed.numpy())
    if read < manifest.total_bytes:
        raise WeightVersionError(f"version {manifest.version}: short read ({read} bytes)")
    tensors = unpack(packed.numpy(), manifest)
    verify(manifest, tensors)
    return tensors


@contextmanager
def _locked(folder: Path, expected: Manifest) -> Iterator[IO[bytes]]:
    """The version's file, open under a shared lock, checked to still be the version's."""
    version = expected.version
    try:
        f = open(folder / "tensors.bin", "rb")
    except FileNotFoundError:
        raise WeightVersionGone(f"version {version} was deleted before it could be read") from None
    with f:
        # Waits only while a publisher rewrites this very file, i.e. the version was deleted
        # meanwhile, which the check below then reports.
        fcntl.flock(f, fcntl.LOCK_SH)
        if not _still_the_version(folder, f, expected):
            raise WeightVersionGone(f"version {version} was deleted while it was being opened")
        _check_size(f, expected)
        yield f


def _check_size(f: IO[bytes], expected: Manifest) -> None:
    size = os.fstat(f.fileno()).st_size
    if size < expected.total_bytes:
        raise WeightVersionError(
            f"version {expected.version}: tensors.bin has {size} bytes, manifest says "
            f"{expected.total_bytes} (truncated)"
        )


def _still_the_version(folder: Path, f: IO[bytes], expected: Manifest) -> bool:
    try:
        on_disk = os.stat(folder / "tensors.bin")
        manifest = Manifest.from_json((folder / "manifest.json").read_text())
    except FileNotFoundError:
        return False
    held = os.fstat(f.fileno())
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino) and manifest == expected
