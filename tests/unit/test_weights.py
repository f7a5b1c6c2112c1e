"""Weight versions: manifests, and the shared-memory transport refusing bad versions."""

import pytest
import torch

from forge.weights.manifest import WeightVersionError, build_manifest, verify
from forge.weights.shm_transport import SharedMemoryTransport
from forge.weights.transport import delete_older_than


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
