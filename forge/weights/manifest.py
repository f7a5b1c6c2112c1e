"""The manifest of a weight version: what a complete version holds, and how to verify it.

A publisher writes every tensor of a version first and its manifest last, so a manifest that
exists describes a complete version. A reader checks each tensor against the manifest (name,
shape, dtype, byte count, xxh3 checksum) before using any of it.

Transports that move a version as one buffer lay its tensors out as the manifest says
(`pack`, `unpack`): back to back in name order, each at an ALIGN boundary.
"""

import json
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
import xxhash


class WeightVersionError(RuntimeError):
    """A weight version is missing, incomplete or corrupted; the reader keeps its old weights."""


class WeightVersionGone(WeightVersionError):
    """A weight version was deleted before it could be read: a newer one exists, load that."""


@dataclass(frozen=True)
class TensorEntry:
    name: str  # Hugging Face naming
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"
    offset: int  # byte offset, for transports that pack tensors into one buffer
    nbytes: int
    checksum: str  # xxh3-64 of the tensor's bytes


@dataclass(frozen=True)
class Manifest:
    version: int
    tensors: tuple[TensorEntry, ...]

    @property
    def total_bytes(self) -> int:
        """The packed size: where the last tensor ends."""
        return max((t.offset + t.nbytes for t in self.tensors), default=0)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        entries = tuple(TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in data["tensors"])
        return cls(version=data["version"], tensors=entries)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (made contiguous first if it is not)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def checksum(tensor: torch.Tensor) -> str:
    """xxh3-64 of a CPU tensor's bytes (a hash faster than memory copies: cheap next to the copy
    it checks)."""
    return xxhash.xxh3_64_hexdigest(tensor_bytes(tensor).numpy())


# Tensors start at multiples of this many bytes: every dtype's view of the packed bytes is
# aligned, so tensors are copied in and read out in their own dtype.
ALIGN = 64


def build_manifest(
    version: int, state_dict: dict[str, torch.Tensor], checksums: dict[str, str] | None = None
) -> Manifest:
    """Describes `state_dict` (CPU tensors) packed in name order, each at an ALIGN boundary.

    `checksums`: by name, when they are already at hand (computed over the bytes as written);
    computed here otherwise.
    """
    entries, offset = [], 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(
            TensorEntry(
                name=name,
                shape=tuple(tensor.shape),
                dtype=str(tensor.dtype).removeprefix("torch."),
                offset=offset,
                nbytes=nbytes,
                checksum=checksums[name] if checksums is not None else checksum(tensor),
            )
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    return Manifest(version=version, tensors=tuple(entries))


def pack(
    packed: torch.Tensor, layout: Manifest, state_dict: dict[str, torch.Tensor], checksum_too: bool
) -> dict[str, str]:
    """Copies each tensor into its place in `packed` (uint8, at least `layout.total_bytes`) in
    one pass from its own strides (no contiguous copy first). Returns the checksums of the bytes
    as written, by name, if `checksum_too` (else empty strings)."""
    return {e.name: _pack_one(packed, e, state_dict[e.name], checksum_too) for e in layout.tensors}


def _pack_one(
    packed: torch.Tensor, e: TensorEntry, tensor: torch.Tensor, checksum_too: bool
) -> str:
    region = packed[e.offset : e.offset + e.nbytes]
    region.view(getattr(torch, e.dtype)).view(e.shape).copy_(tensor)
    return checksum(region) if checksum_too else ""


def unpack(buffer: Any, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over a packed buffer (anything with the buffer protocol), as the
    manifest lays them out."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns when the buffer is read-only
        return {
            e.name: torch.frombuffer(buffer, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
            .view(getattr(torch, e.dtype))
            .reshape(e.shape)
            for e in manifest.tensors
        }


def verify(manifest: Manifest, state_dict: dict[str, torch.Tensor]) -> None:
    """Raises WeightVersionError unless `state_dict` is exactly what `manifest` describes."""
    names = [t.name for t in manifest.tensors]
    if sorted(names) != sorted(state_dict):
        missing = sorted(set(names) - set(state_dict))
        extra = sorted(set(state_dict) - set(names))
        raise WeightVersionError(
            f"version {manifest.version}: tensors do not match the manifest "
            f"(missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for entry in manifest.tensors:
        tensor = state_dict[entry.name]
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tuple(tensor.shape) != entry.shape or dtype != entry.dtype:
            raise WeightVersionError(
                f"version {manifest.version}: {entry.name} is {dtype}{list(tensor.shape)}, "
                f"manifest says {entry.dtype}{list(entry.shape)}"
            )
        if checksum(tensor) != entry.checksum:
            raise WeightVersionError(
                f"version {manifest.version}: checksum mismatch in {entry.name} (corrupted)"
            )
