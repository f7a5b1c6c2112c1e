"""Weight versions: manifests, the shared-memory transport refusing bad versions and never
rewriting bytes a reader holds, and forge's shared-memory folders given back."""

import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from forge.controller import shutdown
from forge.weights.manifest import (
    WeightVersionError,
    WeightVersionGone,
    build_manifest,
    verify,
)
from forge.weights.shm_folders import (
    MARKER,
    SHM_ROOT,
    Owner,
    ShmFolder,
    claim_for_run,
    owner_of,
    remove_dead,
    run_folder,
)
from forge.weights.shm_transport import SharedMemoryTransport, open_version, pin
from forge.weights.transport import TransportConfig, delete_older_than


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(16),
        "step": torch.tensor(3, dtype=torch.int64),
    }


@pytest.fixture
def transport(tmp_path):
    return SharedMemoryTransport(tmp_path / "weights", fetch_timeout_s=0.5)


async def test_round_trip_is_exact_and_ordered(transport):
    sd = state_dict()
    manifest = await transport.publish(1, sd)
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    got = await transport.fetch(1)
    assert list(got) == list(sd)
    for name, tensor in sd.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
    assert await transport.versions() == [1]


async def test_the_publisher_maps_only_files_in_use_and_none_after_clear(transport):
    """The publisher keeps its mapping of each file it wrote while the file is a version's
    or a free one; a deleted file's mapping is dropped at the next publish (its memory given
    back), and `clear` drops them all. Every version reads back exact."""
    root = transport.root
    for version in (1, 2, 3):
        await transport.publish(version, state_dict(version))
    await transport.delete(1)  # kept in free/ for the next publish
    await transport.delete(2)  # free/ is full: removed while the publisher maps it
    assert any(path.endswith("(deleted)") for path in mapped_under(root))
    await transport.publish(4, state_dict(4))  # into version 1's file
    on_disk = {str(p) for p in root.glob("*/*.bin")}
    assert set(mapped_under(root)) == on_disk and len(on_disk) == 2
    for version in (3, 4):
        got = await transport.fetch(version)
        assert all(torch.equal(got[k], t) for k, t in state_dict(version).items())
    await transport.clear()
    assert mapped_under(root) == []


async def test_a_version_published_into_a_free_file_is_not_locked_by_its_publisher(tmp_path):
    """A publisher takes a free file under an exclusive lock; once the version is published,
    readers can lock it, although the publisher keeps its mapping of the file (here a new
    publisher, as a restarted trainer is, maps the file for the first time)."""
    first = SharedMemoryTransport(tmp_path / "weights")
    for version in (1, 2):
        await first.publish(version, state_dict(version))
    await first.delete(1)
    restarted = SharedMemoryTransport(tmp_path / "weights")
    await restarted.publish(3, state_dict(3))  # into version 1's file, mapped afresh
    with open(restarted._dir(3) / "tensors.bin", "rb") as f:
        fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # BlockingIOError if still locked
    got = await restarted.fetch(3)
    assert all(torch.equal(got[k], t) for k, t in state_dict(3).items())


def mapped_under(root) -> list[str]:
    """The files under `root` this process maps."""
    lines = open("/proc/self/maps").read().splitlines()
    return sorted({line.split(None, 5)[5] for line in lines if f" {root}/" in line})


async def test_corrupted_tensor_is_refused(transport):
    await transport.publish(2, state_dict())
    blob = transport._dir(2) / "tensors.bin"
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(WeightVersionError, match="checksum mismatch in model.embed_tokens"):
        await transport.fetch(2)


async def test_truncated_version_is_refused(transport):
    await transport.publish(3, state_dict())
    blob = transport._dir(3) / "tensors.bin"
    blob.write_bytes(blob.read_bytes()[:-8])
    with pytest.raises(WeightVersionError, match="truncated"):
        await transport.fetch(3)


async def test_version_without_manifest_times_out_with_clear_error(transport):
    await transport.publish(4, state_dict())
    (transport._dir(4) / "manifest.json").unlink()  # tensors written, manifest never came
    with pytest.raises(WeightVersionError, match="version 4: no complete manifest"):
        await transport.fetch(4)
    assert await transport.versions() == []


async def test_delete_and_republish(transport):
    await transport.publish(5, state_dict(0))
    await transport.publish(6, state_dict(1))
    await transport.delete(5)
    await transport.delete(5)  # deleting twice is fine
    assert await transport.versions() == [6]
    assert torch.equal((await transport.fetch(6))["model.norm.weight"], torch.ones(16))


def test_verify_names_shape_and_dtype_mismatches():
    sd = state_dict()
    manifest = build_manifest(7, sd)
    with pytest.raises(WeightVersionError, match="missing \\['model.norm.weight'\\]"):
        verify(manifest, {k: v for k, v in sd.items() if k != "model.norm.weight"})
    with pytest.raises(WeightVersionError, match="model.norm.weight is float64"):
        verify(manifest, {**sd, "model.norm.weight": sd["model.norm.weight"].double()})


async def test_versions_older_than_every_generator_are_deleted(transport):
    for version in (1, 2, 3):
        await transport.publish(version, state_dict(version))
    assert await delete_older_than(transport, 3) == [1, 2]
    assert await transport.versions() == [3]


async def test_a_deleted_versions_file_is_rewritten_by_the_next_publish(transport):
    await transport.publish(1, state_dict(1))
    inode = (transport._dir(1) / "tensors.bin").stat().st_ino
    await transport.delete(1)
    await transport.publish(2, state_dict(2))
    assert (transport._dir(2) / "tensors.bin").stat().st_ino == inode
    got = await transport.fetch(2)
    assert all(torch.equal(got[k], v) for k, v in state_dict(2).items())
    assert await transport.versions() == [2]


async def test_clear_leaves_nothing_in_shared_memory(tmp_path):
    (tmp_path / "runs" / "other").mkdir(parents=True)  # a sibling that is not ours stays
    transport = SharedMemoryTransport(tmp_path / "runs" / "nested" / "run")
    for version in (1, 2):
        await transport.publish(version, state_dict(version))
    await transport.delete(1)  # its file waits in free/ for the next publish
    await transport.clear()
    assert not (tmp_path / "runs" / "nested").exists()
    assert (tmp_path / "runs" / "other").exists()
    assert await transport.versions() == []


def inode(transport: SharedMemoryTransport, version: int) -> int:
    return (transport._dir(version) / "tensors.bin").stat().st_ino


def free_files(transport: SharedMemoryTransport) -> int:
    return len(list((transport.root / "free").glob("*.bin")))


async def test_a_pinned_file_is_never_rewritten_and_one_spare_is_kept(transport):
    await transport.publish(1, state_dict(1))
    folder, manifest = await transport.locate(1)
    with pin(folder, manifest) as path:
        await transport.delete(1)  # its file goes to free/, still pinned
        await transport.publish(2, state_dict(2))  # must not take it: writes a fresh file
        await transport.publish(3, state_dict(3))
        await transport.delete(2)  # free/ holds one spare already: this file is dropped
        assert free_files(transport) == 1
        with open_version(path, manifest) as tensors:  # verifies against version 1's manifest
            assert torch.equal(tensors["model.norm.weight"], state_dict(1)["model.norm.weight"])
    pinned = os.stat(folder.parent / "free" / os.listdir(folder.parent / "free")[0]).st_ino
    await transport.publish(4, state_dict(4))  # unpinned now: the spare is rewritten
    assert inode(transport, 4) == pinned and free_files(transport) == 0
    got = await transport.fetch(4)
    assert all(torch.equal(got[k], v) for k, v in state_dict(4).items())


async def test_pinning_a_deleted_version_says_it_is_gone(transport):
    await transport.publish(1, state_dict(1))
    folder, manifest = await transport.locate(1)
    await transport.delete(1)
    await transport.publish(2, state_dict(2))  # rewrites version 1's file
    with pytest.raises(WeightVersionGone, match="version 1 was deleted"):
        with pin(folder, manifest):
            pass


async def test_a_superseded_version_fails_fast(tmp_path):
    transport = SharedMemoryTransport(tmp_path / "weights", fetch_timeout_s=30.0)
    for version in (1, 2):
        await transport.publish(version, state_dict(version))
    await transport.delete(1)
    start = time.monotonic()
    with pytest.raises(WeightVersionGone, match="version 1 was deleted or never completed"):
        await transport.fetch(1)
    assert time.monotonic() - start < 1.0  # not the 30 s manifest wait


async def test_an_unset_shm_path_fails_on_use_with_the_fix():
    with pytest.raises(ValueError, match="has no path: set weight_sync.transport.path, or start"):
        await SharedMemoryTransport(None).versions()


def test_folders_of_dead_owners_are_removed_and_others_kept(tmp_path):
    live = ShmFolder.create("live", root=tmp_path)
    script = (
        "import sys; from pathlib import Path; from forge.weights.shm_folders import ShmFolder; "
        "ShmFolder.create('dead', root=Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True)  # exits: dead
    reused = ShmFolder.create("reused-pid", root=tmp_path)  # our pid, another start time
    marker = dataclasses.replace(Owner.this_process(), started=1.0)
    (reused.path / MARKER).write_text(json.dumps(dataclasses.asdict(marker)))
    (tmp_path / "forge-unmarked").mkdir()  # not known to be ours: left alone
    (tmp_path / "forge-dead" / "blob").write_bytes(b"x" * 1000)
    removed = remove_dead(tmp_path)
    assert [p.name for p, _, _ in removed] == ["forge-dead", "forge-reused-pid"]
    assert removed[0][2] > 1000  # the bytes it freed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forge-live", "forge-unmarked"]
    live.remove()
    assert not live.path.exists()


def test_a_folder_of_a_live_process_is_not_taken(tmp_path):
    parent = os.getppid()
    taken = tmp_path / "forge-taken"
    taken.mkdir()
    marker = Owner.of(parent, "run elsewhere")
    (taken / MARKER).write_text(json.dumps(dataclasses.asdict(marker)))
    with pytest.raises(RuntimeError, match=f"belongs to a running process \\(pid {parent}"):
        ShmFolder.create("taken", root=tmp_path)


def test_a_live_owner_stays_alive_when_the_clock_moves(tmp_path, monkeypatch):
    """The kernel's boot time follows wall-clock adjustments (NTP): a marker written before one
    must still name its live owner, or another run's start removes the folder under it."""
    folder = ShmFolder.create("live", root=tmp_path)
    real_boot_time = psutil.boot_time()
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real_boot_time + 1.0)
    assert owner_of(folder.path).alive()
    assert remove_dead(tmp_path) == [] and folder.path.exists()


async def test_a_run_gets_a_flat_folder_given_back_at_shutdown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_folder("runs/a") == run_folder(tmp_path / "runs" / "a")
    assert run_folder("runs/a").parent == SHM_ROOT and run_folder("runs/a").name.startswith(
        "forge-run-"
    )

    unset, chosen = TransportConfig(), TransportConfig(path="/elsewhere")
    store = TransportConfig(kind="torchstore")
    folder = claim_for_run("runs/a", unset)
    try:
        # Only an shm transport without a path is pointed at the run's folder.
        others = [claim_for_run(f"runs/{name}", t) for name, t in (("b", chosen), ("c", store))]
        assert folder.path == run_folder("runs/a")
        assert Owner(**json.loads((folder.path / MARKER).read_text())).pid == os.getpid()
        assert (unset.path, chosen.path, store.path) == (
            str(folder.path / "weights"),
            "/elsewhere",
            None,
        )
        await SharedMemoryTransport(unset.path).publish(1, state_dict())
    finally:
        await shutdown()
    assert not folder.path.exists() and not any(o.path.exists() for o in others)
