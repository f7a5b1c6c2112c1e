"""How weight versions travel from the trainer to generators.

A transport publishes a version (tensors first, manifest last) and fetches one (waiting for its
manifest up to a deadline, then verifying every tensor against it). Three exist: same-host
shared memory (`SharedMemoryTransport`), and across hosts torchstore (`TorchStoreTransport`)
and Monarch RDMA buffers with torchstore holding only manifests and handles (`RdmaTransport`).
"""

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from forge.config import positive
from forge.weights.manifest import Manifest


@dataclass
class TransportConfig:
    """Which transport carries weights, and where.

    Args:
        kind: "shm" (same host, /dev/shm), "rdma" (any host: one Monarch RDMA read per version,
            over Monarch's TCP fallback without an RDMA NIC) or "torchstore" (any host: each
            tensor through a torchstore storage volume).
        path: shm: the folder that holds versions; None (the default): the run's own folder in
            shared memory, which a run sets (forge.weights.shm_folders.claim_for_run) and
            removes when it ends. rdma and torchstore: the key prefix; None: "weights".
        fetch_timeout_s: how long a fetch waits for a version's manifest to appear (it fails
            at once if a newer version exists: the one asked for was deleted).
    """

    kind: Literal["shm", "rdma", "torchstore"] = "shm"
    path: str | None = None
    fetch_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        positive(self, "fetch_timeout_s")


class WeightTransport(Protocol):
    async def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> Manifest:
        """Writes every tensor of `state_dict` (HF names), then the manifest."""
        ...

    async def fetch(self, version: int) -> dict[str, torch.Tensor]:
        """Waits for `version`'s manifest, reads the tensors and verifies them.

        Raises WeightVersionGone if it was deleted (a newer version exists), WeightVersionError
        if it does not appear in time or fails to verify.
        """
        ...

    async def delete(self, version: int) -> None:
        """Removes a version; deleting one that does not exist does nothing."""
        ...

    async def versions(self) -> list[int]:
        """The complete versions (those with a manifest), oldest first."""
        ...

    async def clear(self) -> None:
        """Removes every version and whatever is kept for reuse: the run's end."""
        ...


def make_transport(cfg: TransportConfig) -> WeightTransport:
    """The transport `cfg` names."""
    if cfg.kind == "shm":
        from forge.weights.shm_transport import SharedMemoryTransport

        return SharedMemoryTransport(cfg.path, cfg.fetch_timeout_s)
    if cfg.kind == "torchstore":
        from forge.weights.torchstore_transport import TorchStoreTransport

        return TorchStoreTransport(cfg.path or "weights", cfg.fetch_timeout_s)
    if cfg.kind == "rdma":
        from forge.weights.rdma_transport import RdmaTransport

        return RdmaTransport(cfg.path or "weights", cfg.fetch_timeout_s)
    raise ValueError(f"transport kind must be 'shm', 'rdma' or 'torchstore', got {cfg.kind!r}")


async def delete_older_than(transport: WeightTransport, version: int) -> list[int]:
    """Deletes every version older than `version`: call it once every generator runs `version`
    or newer. Returns the deleted versions."""
    old = [v for v in await transport.versions() if v < version]
    for v in old:
        await transport.delete(v)
    return old
