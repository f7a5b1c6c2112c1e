"""Weight sync from a TitanTrainer to a vLLM Generator, against this machine's copy bandwidth.

For SmolLM2-135M and each transport, in one run: the bytes of one version, the raw memory-copy
bandwidth (a preallocated `dst.copy_(src)`), and per version the trainer's publish (gather + HF
renaming + write), the generator's fetch (wait for the manifest, pin the file; rdma and
torchstore: move it and stage it), its prepare (the engine verifies the version and builds it
beside its live weights while it goes on generating) and its swap (engine stopped: the built
weights swapped in, resume). Each phase is printed as a multiple of bytes / copy bandwidth; shm
in float32 and bfloat16 (`--dtypes`: the engine's dtype, which versions are published in), the
other transports in float32.
The cross-host transports (rdma, torchstore) are also compared with the simplest alternative
on Monarch: one raw `RDMABuffer.read_into` of the same bytes between two processes, into a
buffer already allocated (over Monarch's TCP fallback where there is no RDMA NIC).
Versions are retired as a run retires them, so the steady state is what is reported: the median
of versions 3..N. The first two each create the file (shm) or buffer (rdma) that every later
version reuses, a run holding at most two at a time; their figures are printed as they come.

With `--across-nodes` it moves SmolLM2's tensors over torchstore between the two nodes of the
test SLURM cluster (`.ci/slurm.sh`, partition `two`: two network namespaces on a bridge), the
store and the publisher on one node, the fetcher on the other, and compares the rate with a raw
TCP copy of the same bytes between the same two nodes, into a buffer already allocated.

With `--lora` it compares, over shared memory, a full trainer with a LoRA one (rank 16 on every
linear layer of the decoder) publishing adapters, and one publishing merged weights
(`weight_sync.lora.publish: merged`): each takes a GRPO step on 16 sequences before each
version, and the bench prints for each the bytes of a version, publish + fetch + swap, their
ratios to full weights', and the trainer's peak resident memory over its steps.

    python bench/weight_sync.py [--versions 6] [--transports shm rdma torchstore]
        [--dtypes float32 bfloat16] [--lora] [--across-nodes]
"""

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings

import cloudpickle
import monarch.rdma
import torch
from library_log import library_output_to_log
from monarch.actor import Actor, endpoint, this_host
from monarch.rdma import RDMABuffer, RDMATcpFallbackWarning
from result import Result
from trainer_memory import batch as grpo_batch

from forge.actors.generator import Generator, GeneratorConfig
from forge.actors.trainer import TitanTrainer, TrainerConfig
from forge.controller import (
    ProcessConfig,
    ProvisionerConfig,
    SlurmConfig,
    get_provisioner,
    init_provisioner,
    shutdown,
)
from forge.models import smollm2
from forge.models.lora import LoRAConfig
from forge.models.titan import hf_state_dict
from forge.observability.console import say
from forge.weights import torchstore_compat
from forge.weights.shm_folders import ShmFolder
from forge.weights.sync_config import WeightSyncConfig
from forge.weights.torchstore_transport import TorchStoreTransport
from forge.weights.transport import TransportConfig, delete_older_than, make_transport

# The raw-transfer actors live in this script, which their processes cannot import: ship them
# by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of copying `nbytes` between two preallocated, already-touched buffers."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


class RawOwner(Actor):
    """Holds `nbytes` in a registered RDMA buffer."""

    @endpoint
    async def buffer(self, nbytes: int) -> RDMABuffer:
        self.data = torch.ones(nbytes, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RDMATcpFallbackWarning)
            return RDMABuffer(self.data)


class RawReader(Actor):
    """Reads a remote buffer into one of its own, allocated and touched before timing."""

    @endpoint
    async def read(self, buffer: RDMABuffer, repeats: int) -> float:
        dst = torch.zeros(buffer.size(), dtype=torch.uint8)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            await buffer.read_into(dst, timeout=600)
            times.append(time.perf_counter() - start)
        assert bool(dst[-1] == 1), "the read moved no bytes"
        return statistics.median(times)


async def raw_rdma_rate(nbytes: int, repeats: int = 3) -> float:
    """Bytes/s of one raw Monarch RDMA read of `nbytes` between two processes (median)."""
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="raw_rdma")
    try:
        owner = procs.slice(procs=0).spawn("owner", RawOwner)
        reader = procs.slice(procs=1).spawn("reader", RawReader)
        buffer = await owner.buffer.call_one(nbytes)
        return nbytes / await reader.read.call_one(buffer, repeats)
    finally:
        await procs.stop()


# The first version reported: versions 1 and 2 each allocate what the later ones reuse.
WARM = 3


async def measure(
    transport: TransportConfig,
    versions: int,
    lora: LoRAConfig | None = None,
    train: bool = False,
    dtype: str = "float32",
) -> dict[str, float]:
    """Median per-phase seconds over versions WARM..N for one transport and engine dtype; with
    `train`, a GRPO step before each version, and the trainer's peak memory over them
    ("peak_rss_gb")."""
    model, sync = str(smollm2()), WeightSyncConfig(transport, lora=lora, dtype=dtype)
    trainer = await TitanTrainer.as_actor(TrainerConfig(model=model, micro_batch_size=8), sync)
    generator = await Generator.as_actor(
        GeneratorConfig(model=model, max_model_len=512, kv_cache_mb=64), sync
    )
    store = make_transport(transport)
    names = ("publish", "fetch", "prepare", "swap", "pause", "verify", "bytes", "peak_rss_gb")
    phases: dict[str, list[float]] = {name: [] for name in names}
    for version in range(1, versions + 1):
        if train:
            step = await trainer.train_step.call_one([grpo_batch(16, seed=version)])
            phases["peak_rss_gb"].append(step["peak_rss_gb"])
        pushed = await trainer.push_weights.call_one(version)
        updated = await generator.update_weights.call_one(version)
        await delete_older_than(store, version)
        if version >= WARM:
            phases["publish"].append(pushed["gather_s"] + pushed["publish_s"])
            phases["bytes"].append(pushed["bytes"])
            for phase in ("fetch", "prepare", "pause", "swap", "verify"):
                phases[phase].append(updated[f"{phase}_s"])
        say(
            f"  {transport.kind} {dtype} v{version}: publish {pushed['publish_s']:.3f}s "
            f"(+ gather {pushed['gather_s']:.3f}s), fetch {updated['fetch_s']:.3f}s, "
            f"prepare {updated['prepare_s']:.3f}s (verify {updated['verify_s']:.3f}s), "
            f"swap {updated['swap_s']:.3f}s",
        )
    await shutdown()
    peaks = phases.pop("peak_rss_gb")
    medians = {name: statistics.median(values) for name, values in phases.items()}
    return {**medians, "peak_rss_gb": max(peaks)} if peaks else medians


async def compare_lora(versions: int, bound: float, result: Result) -> None:
    """Full weights against a LoRA adapter over shared memory, from this one run."""
    results = {}
    adapter = LoRAConfig(rank=16, alpha=32.0)
    merged = LoRAConfig(rank=16, alpha=32.0, publish="merged")
    for name, lora in (("full", None), ("lora", adapter), ("lora, merged", merged)):
        shm = ShmFolder.create(f"bench-weight-sync-{os.getpid()}", "bench/weight_sync.py")
        try:
            cfg = TransportConfig(kind="shm", path=str(shm.path))
            results[name] = await measure(cfg, versions, lora, train=True)
        finally:
            await shutdown()
            shm.remove()
    for name, r in results.items():
        total = r["publish"] + r["fetch"] + r["prepare"] + r["swap"]
        say(
            f"{name:12s} {r['bytes'] / 1e6:8.2f} MB a version  publish {r['publish']:.3f}s  "
            f"fetch {r['fetch']:.3f}s  prepare {r['prepare']:.3f}s  swap {r['swap']:.3f}s  "
            f"total {total:.3f}s "
            f"({total / bound:.1f}x the full copy bound)  "
            f"trainer peak RSS {r['peak_rss_gb']:.2f} GB"
        )
        result.figure(f"{name}: a version", r["bytes"] / 1e6, "MB")
        result.figure(f"{name}: publish + fetch + prepare + swap", total, "s")
        result.figure(f"{name}: trainer peak RSS", r["peak_rss_gb"], "GB")
    full = results.pop("full")
    for name, r in results.items():
        seconds = [x["publish"] + x["fetch"] + x["prepare"] + x["swap"] for x in (full, r)]
        say(
            f"{name} / full: bytes {r['bytes'] / full['bytes']:.4f}, all phases "
            f"{seconds[1] / seconds[0]:.3f}, trainer peak RSS "
            f"{r['peak_rss_gb'] / full['peak_rss_gb']:.3f}"
        )
        result.ratio(f"{name} / full: bytes", r["bytes"] / full["bytes"])
        result.ratio(f"{name} / full: publish + fetch + prepare + swap", seconds[1] / seconds[0])
        result.ratio(f"{name} / full: trainer peak RSS", r["peak_rss_gb"] / full["peak_rss_gb"])


class NodePublisher(Actor):
    """Publishes versions of tensors shaped as `shapes` into torchstore."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.state_dict = {name: torch.randn(shape) for name, shape in shapes.items()}
        self.transport = TorchStoreTransport("bench-nodes")

    @endpoint
    async def publish(self, version: int) -> float:
        start = time.perf_counter()
        await self.transport.publish(version, self.state_dict)
        return time.perf_counter() - start


class NodeFetcher(Actor):
    """Fetches versions from torchstore (unverified: the bytes' movement alone)."""

    def __init__(self) -> None:
        self.transport = TorchStoreTransport("bench-nodes")

    @endpoint
    async def fetch(self, version: int) -> float:
        start = time.perf_counter()
        await self.transport.fetch_unverified(version)
        return time.perf_counter() - start


class TcpReceiver(Actor):
    """Receives bytes over one TCP connection into a buffer allocated and touched before."""

    @endpoint
    async def listen(self, nbytes: int) -> tuple[str, int]:
        self.buffer = bytearray(nbytes)
        self.server = socket.create_server(("", 0))
        return socket.gethostname(), self.server.getsockname()[1]

    @endpoint
    async def receive(self) -> float:
        return await asyncio.to_thread(self._receive)

    def _receive(self) -> float:
        with self.server:
            conn, _ = self.server.accept()
        view, got = memoryview(self.buffer), 0
        start = time.perf_counter()
        with conn:
            while got < len(view):
                got += conn.recv_into(view[got:])
        return time.perf_counter() - start


class TcpSender(Actor):
    """Sends `nbytes` of a buffer allocated and touched before the connection."""

    @endpoint
    async def send(self, host: str, port: int, nbytes: int) -> None:
        data = bytes(nbytes)
        with socket.create_connection((host, port)) as conn:
            await asyncio.to_thread(conn.sendall, data)


def _address_towards(host: str) -> str:
    """This machine's address on the route to `host` (this machine's name may be loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))  # no packet: it only picks the route
        return s.getsockname()[0]


async def compare_across_nodes(versions: int, result: Result) -> None:
    """torchstore's rate between the two nodes of partition `two`, against raw TCP's."""
    state_dict = hf_state_dict(smollm2())
    shapes = {name: tuple(t.shape) for name, t in state_dict.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    slurm = SlurmConfig(
        partition="two",
        time="00:20:00",
        log_dir=tempfile.gettempdir(),
        driver_address=_address_towards("forge-node1"),
    )
    init_provisioner(ProvisionerConfig(launcher="slurm", hosts=2, cpus_per_host=1, slurm=slurm))
    try:
        first, second = [
            await get_provisioner().spawn_procs(ProcessConfig(cpus_per_proc=1, mesh_name=name))
            for name in ("publisher", "fetcher")
        ]
        # The store beside the publisher; shutdown() below stops it.
        await torchstore_compat.initialize(mesh=first)
        publisher = first.spawn("publisher", NodePublisher, shapes)
        fetcher = second.spawn("fetcher", NodeFetcher)
        receiver = second.spawn("receiver", TcpReceiver)
        sender = first.spawn("sender", TcpSender)
        owner = first.spawn("owner", RawOwner)
        buffer = await owner.buffer.call_one(nbytes)
        monarch_read = await second.spawn("reader", RawReader).read.call_one(buffer, 3)
        raw, moved = [], []
        for version in range(1, versions + 1):
            host, port = await receiver.listen.call_one(nbytes)
            copied, _ = await asyncio.gather(
                receiver.receive.call_one(), sender.send.call_one(host, port, nbytes)
            )
            published = await publisher.publish.call_one(version)
            fetched = await fetcher.fetch.call_one(version)
            say(
                f"  v{version}: raw TCP {copied:.3f}s; torchstore publish {published:.3f}s, "
                f"fetch {fetched:.3f}s"
            )
            if version >= WARM:
                raw.append(copied)
                moved.append((published, fetched))
    finally:
        await shutdown()
    copy = statistics.median(raw)
    publish = statistics.median(p for p, _ in moved)
    fetch = statistics.median(f for _, f in moved)
    say(
        f"between the nodes: raw TCP {nbytes / copy / 1e9:.3f} GB/s; raw Monarch RDMA read "
        f"({monarch.rdma.get_rdma_backend()}) {nbytes / monarch_read / 1e9:.3f} GB/s = "
        f"{copy / monarch_read:.2f}x raw TCP; torchstore fetch "
        f"{nbytes / fetch / 1e9:.3f} GB/s = {copy / fetch:.2f}x raw; publish + fetch "
        f"{nbytes / (publish + fetch) / 1e9:.3f} GB/s = {copy / (publish + fetch):.2f}x raw"
    )
    result.figure("bytes per version (SmolLM2-135M, fp32)", nbytes / 1e6, "MB")
    result.figure("raw TCP copy between the nodes", nbytes / copy / 1e9, "GB/s")
    result.figure(
        f"raw Monarch RDMA read ({monarch.rdma.get_rdma_backend()}) between the nodes",
        nbytes / monarch_read / 1e9,
        "GB/s",
    )
    result.ratio("raw Monarch RDMA read rate / raw TCP copy rate", copy / monarch_read)
    result.figure("torchstore: publish (on the store's node)", publish, "s")
    result.figure("torchstore: fetch (across the nodes)", fetch, "s")
    # The fetch is what crosses between the nodes; the publish stays on the store's node.
    result.ratio(
        "torchstore fetch rate / raw TCP copy rate", copy / fetch, target=">= 0.5", headline=True
    )
    result.ratio("torchstore publish + fetch rate / raw TCP copy rate", copy / (publish + fetch))


async def main(args: argparse.Namespace) -> None:
    if args.across_nodes:
        result = Result("weight_sync-nodes")
        await compare_across_nodes(args.versions, result)
        result.write()
        return
    nbytes = sum(t.numel() * t.element_size() for t in hf_state_dict(smollm2()).values())
    bandwidth = copy_bandwidth(nbytes)
    bound = nbytes / bandwidth
    say(f"bytes per version (SmolLM2-135M, fp32): {nbytes / 1e6:.1f} MB")
    say(f"raw copy bandwidth: {bandwidth / 1e9:.2f} GB/s -> bytes / bandwidth = {bound:.3f} s")
    result = Result("weight_sync-lora" if args.lora else "weight_sync")
    result.figure("bytes per version (SmolLM2-135M, fp32)", nbytes / 1e6, "MB")
    result.figure("raw copy bandwidth", bandwidth / 1e9, "GB/s")
    if args.lora:
        await compare_lora(args.versions, bound, result)
        result.write()
        return
    raw = None
    if {"rdma", "torchstore"} & set(args.transports):
        raw = await raw_rdma_rate(nbytes)
        backend = monarch.rdma.get_rdma_backend()
        say(f"raw Monarch RDMA read ({backend}), process to process: {raw / 1e9:.3f} GB/s")
        result.figure(f"raw Monarch RDMA read ({backend})", raw / 1e9, "GB/s")
    for kind in args.transports:
        for dtype in args.dtypes if kind == "shm" else ["float32"]:
            r = await measure_transport(kind, args.versions, dtype)
            report(kind, dtype, r, nbytes, bandwidth, raw, result)
    result.write()


async def measure_transport(kind: str, versions: int, dtype: str) -> dict[str, float]:
    shm = ShmFolder.create(f"bench-weight-sync-{os.getpid()}", "bench/weight_sync.py")
    try:
        if kind == "shm":
            cfg = TransportConfig(kind="shm", path=str(shm.path))
        else:
            await torchstore_compat.initialize()  # stopped by measure's shutdown()
            cfg = TransportConfig(kind=kind, path="bench-weights")
        return await measure(cfg, versions, dtype=dtype)
    finally:
        await shutdown()  # a no-op after measure's, unless it failed
        shm.remove()


def report(
    kind: str,
    dtype: str,
    r: dict[str, float],
    nbytes: int,
    bandwidth: float,
    raw: float | None,
    result: Result,
) -> None:
    """Prints one transport's phases against the copy bound of its bytes, and records them
    (float32 under the transport's name, other dtypes with theirs)."""
    name = kind if dtype == "float32" else f"{kind} ({dtype})"
    nbytes = int(r["bytes"]) or nbytes
    bound = nbytes / bandwidth
    moved = r["publish"] + r["fetch"]
    total = moved + r["prepare"] + r["swap"]
    say(
        f"{name:18s} {nbytes / 1e6:.0f} MB: publish {r['publish']:.3f}s  fetch {r['fetch']:.3f}s"
        f"  prepare {r['prepare']:.3f}s (verify {r['verify']:.3f}s)  swap {r['swap']:.3f}s  "
        f"total {total:.3f}s = {total / bound:.1f}x bound (publish + fetch {moved / bound:.1f}x;"
        f" prepare, generation going on, {r['prepare'] / bound:.1f}x; swap, engine stopped, "
        f"{r['swap'] / bound:.1f}x)"
    )
    for phase in ("publish", "fetch", "prepare", "swap"):
        result.figure(f"{name}: {phase}", r[phase], "s")
    result.figure(f"{name}: publish + fetch + prepare + swap", total, "s")
    result.ratio(
        f"{name}: publish + fetch / (bytes / copy bandwidth)", moved / bound, headline=name == "shm"
    )
    result.ratio(f"{name}: prepare / (bytes / copy bandwidth)", r["prepare"] / bound)
    result.ratio(f"{name}: swap / (bytes / copy bandwidth)", r["swap"] / bound, target="<= 2")
    if kind != "shm" and raw is not None:
        rate = nbytes / moved
        say(
            f"{'':18s} moves {rate / 1e9:.3f} GB/s (publish + fetch) = {rate / raw:.2f} x "
            f"the raw Monarch RDMA read of the same bytes ({raw / 1e9:.3f} GB/s)"
        )
        result.ratio(f"{kind}: publish + fetch rate / raw Monarch RDMA read", rate / raw)


if __name__ == "__main__":
    library_output_to_log("weight_sync")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument(
        "--transports",
        nargs="+",
        default=["shm", "rdma", "torchstore"],
        choices=["shm", "rdma", "torchstore"],
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16"],
        help="engine dtypes measured over shm (the other transports: float32)",
    )
    parser.add_argument(
        "--lora", action="store_true", help="full weights against a LoRA adapter, over shm"
    )
    parser.add_argument(
        "--across-nodes",
        action="store_true",
        help="torchstore between the two nodes of the test SLURM cluster, against raw TCP",
    )
    args = parser.parse_args()
    if args.versions < WARM:
        parser.error(f"--versions must be at least {WARM}: versions {WARM}.. are the ones reported")
    asyncio.run(main(args))
