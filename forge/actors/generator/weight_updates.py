"""The generator's weight-update controller: moves its engine from one version to the next.

An update first finds the version and pins its file (rdma, torchstore: fetches it and stages it
in this host's shared memory first). Then, one update at a time, the engine verifies the pinned
bytes and builds the version beside its live weights (`forge.actors.vllm.staged_weights`; a model it
cannot build that way verifies and reloads in the pause instead). The requests in flight go on
generating all along; new ones wait for the update to end, so that they generate on its version
(`settled`). The update pauses the engine as the update mode says, swaps the built weights in,
records the version, and resumes. A version that is missing, incomplete, corrupted or does not
fit the model is refused, before any pause; the engine keeps serving the weights it had.

With LoRA a version is an adapter: it is verified and written as a PEFT folder here, before
the pause, and the swap is vLLM loading that adapter in place (`AdapterSlot`).
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from forge.actors.generator.adapter import AdapterSlot
from forge.actors.generator.config import GeneratorConfig, UpdateMode
from forge.weights.manifest import Manifest, WeightVersionError, WeightVersionGone
from forge.weights.shm_folders import ShmFolder
from forge.weights.shm_transport import SharedMemoryTransport, open_version, pin
from forge.weights.transport import TransportConfig, make_transport

logger = logging.getLogger(__name__)

STAGE_POLL_S = 0.01  # between asking an engine whether the version it builds is ready


class WeightUpdates:
    """Weight updates of one engine.

    Args:
        engine: a running vLLM AsyncLLM whose workers have forge's WeightLoader extension.
        cfg: the drain timeout and the in-flight KV choice.
        transport: where versions come from (the run's weight_sync.transport).
        shapes: the model's tensor names and shapes (with LoRA, the adapter's); a version
            must match them exactly.
        adapter: the engine's LoRA adapter, when versions are adapters.
    """

    def __init__(
        self,
        engine: Any,
        cfg: GeneratorConfig,
        transport: TransportConfig,
        shapes: dict[str, tuple],
        adapter: AdapterSlot | None = None,
    ) -> None:
        self.engine = engine
        self.cfg = cfg
        self.shapes = shapes
        self.adapter = adapter
        self.fetch_timeout_s = transport.fetch_timeout_s
        self.transport = make_transport(transport)
        self.version = 0
        self.aborting_swaps = 0  # read by the request layer, to continue what a swap aborted
        self.aborting = False  # an aborting swap is under way (from its count until resumed)
        self._lock = asyncio.Lock()
        self._under_way = 0  # updates asked for and not yet over
        self._settled = asyncio.Event()  # set while none is
        self._settled.set()
        self._staging: ShmFolder | None = None  # rdma, torchstore: versions staged for the engine

    async def start(self) -> None:
        """Tells the engine its version (0: the checkpoint's weights, or a zero adapter), for
        per-token versions."""
        if self.adapter is not None:
            await self.adapter.start(self.engine)
        await self.engine.update_weight_version(str(self.version))

    async def update(self, version: int, mode: UpdateMode) -> dict[str, Any]:
        """Loads `version`; generation pauses only for the swap. Requests made meanwhile wait
        for it (`settled`): they generate on `version`.

        Returns the mode used and seconds: `fetch_s` (finding and pinning the version),
        `prepare_s` (verifying and building it beside the live weights), both while generation
        goes on, `pause_s` (drain: in-flight requests finishing, nothing admitted), `swap_s`
        (engine stopped: swap, resume), `verify_s` (the checksum pass, part of prepare_s; of
        swap_s for a model verified in the pause), `prepared` (whether the version was
        verified and built before the pause); and when the preparation, the pause, the swap
        and the update began or ended on the wall clock (`prepare_at`, `pause_at`, `swap_at`,
        `end_at`).
        Raises WeightVersionError (naming the version kept) if the version is refused.
        """
        if version == self.version:
            return dict.fromkeys(("fetch_s", "prepare_s", "pause_s", "swap_s", "verify_s"), 0.0) | {
                "mode": "none",
                "prepared": False,
            }
        start = time.perf_counter()
        self._under_way += 1
        self._settled.clear()
        try:
            async with contextlib.AsyncExitStack() as stack:
                path, manifest = await self._pin(version, stack)
                async with self._lock:
                    fetched, prepare_at = time.perf_counter(), time.time()
                    swap, prepared = await self._prepare(path, manifest)
                    built, pause_at = time.perf_counter(), time.time()
                    used = await self._pause(mode)
                    paused, swap_at = time.perf_counter(), time.time()
                    try:
                        verify_s = await swap()
                        self.version = version
                        await self.engine.update_weight_version(str(version))
                    finally:
                        await self.engine.resume_generation()
                        self.aborting = False
        except WeightVersionError as e:
            raise type(e)(f"{e}; generator stays on version {self.version}") from None
        finally:
            self._under_way -= 1
            if not self._under_way:
                self._settled.set()
        done = time.perf_counter()
        logger.info("weights v%d loaded (%s): paused %.3fs", version, used, done - built)
        return {
            "mode": used,
            "fetch_s": fetched - start,
            "prepare_s": built - fetched,
            "pause_s": paused - built,
            "swap_s": done - paused,
            "verify_s": verify_s,
            "prepared": prepared,  # verified and built before the pause
            # The same moments on the wall clock, for a timeline beside other processes'.
            "prepare_at": prepare_at,
            "pause_at": pause_at,
            "swap_at": swap_at,
            "end_at": time.time(),
        }

    async def settled(self) -> None:
        """Returns once no update is under way. A request waits for it before it enters the
        engine, so that one made after an update was asked for generates on that update's
        version: the admission gate's bound on policy age counts on it (forge/data/admission.py),
        and requests already in flight go on generating while the version is fetched and built.
        """
        await self._settled.wait()

    async def load_latest(self, mode: UpdateMode) -> int:
        """Loads the newest complete version in the transport; returns the version held.

        A version deleted before it could be loaded gives way to the newer one that replaced
        it, until `transport.fetch_timeout_s` has passed.
        """
        deadline = time.monotonic() + self.fetch_timeout_s
        while (versions := await self.transport.versions()) and versions[-1] > self.version:
            try:
                await self.update(versions[-1], mode)
                break
            except WeightVersionGone:
                if time.monotonic() > deadline:
                    raise
        return self.version

    def close(self) -> None:
        """Removes the staging folder (rdma, torchstore) and the adapter's, if made."""
        if self._staging is not None:
            self._staging.remove()
            self._staging = None
        if self.adapter is not None:
            self.adapter.close()

    async def _pin(self, version: int, stack: contextlib.AsyncExitStack) -> tuple[Path, Manifest]:
        """A path to `version`'s packed file, which cannot change or vanish until `stack`
        closes, and its manifest. Not verified here: the engine verifies what it maps."""
        transport = self.transport
        if not isinstance(transport, SharedMemoryTransport):  # rdma, torchstore: stage it here
            manifest, tensors = await transport.fetch_unverified(version)
            transport = self._staging_transport()
            await transport.publish(version, tensors, manifest)
            stack.push_async_callback(transport.delete, version)
        folder, manifest = await transport.locate(version)
        self._check_fits(manifest)
        # A thread: the lock waits while a publisher rewrites the file (a deleted version).
        path = await asyncio.to_thread(stack.enter_context, pin(folder, manifest))
        return path, manifest

    def _staging_transport(self) -> SharedMemoryTransport:
        if self._staging is None:
            self._staging = ShmFolder.create(f"staging-{uuid.uuid4().hex[:16]}", "generator")
        return SharedMemoryTransport(self._staging.path)

    def _check_fits(self, manifest: Manifest) -> None:
        shapes = {e.name: e.shape for e in manifest.tensors}
        if shapes != self.shapes:
            wrong = sorted(set(shapes.items()) ^ set(self.shapes.items()))
            raise WeightVersionError(
                f"version {manifest.version} does not fit the model: first differences {wrong[:3]}"
            )

    async def _pause(self, mode: UpdateMode) -> str:
        """Pauses the engine as `mode` says; returns the mode actually used."""
        if mode == "inflight":
            await self.engine.pause_generation(
                mode="keep", clear_cache=self.cfg.inflight_recompute_kv
            )
            return mode
        used = mode
        if mode == "drain":
            try:
                async with asyncio.timeout(self.cfg.drain_timeout_s):
                    await self.engine.pause_generation(mode="wait", clear_cache=False)
                return mode
            except TimeoutError:
                logger.warning("drain outlasted %.0fs: aborting", self.cfg.drain_timeout_s)
                used = "abort (drain timed out)"
        self.aborting = True
        self.aborting_swaps += 1
        await self.engine.pause_generation(mode="abort", clear_cache=False)
        return used

    async def _prepare(
        self, path: Path, manifest: Manifest
    ) -> tuple[Callable[[], Awaitable[float]], bool]:
        """Everything of the swap that can be done while the engine generates: an adapter
        verified and written as a PEFT folder, or full weights verified and built in the
        engine beside its live ones (one whose swap then fails stays there until the next
        update replaces it). Returns the swap itself, which returns the seconds its version's
        verification took, and whether the version was prepared (False: a model the engine
        cannot build beside its weights, verified and reloaded in the pause)."""
        if self.adapter is not None:
            folder, verify_s = await asyncio.to_thread(self._write_adapter, path, manifest)
            return lambda: self._swap(self.adapter.load(self.engine, folder), verify_s), True
        kwargs = {"path": str(path), "manifest_json": manifest.to_json()}
        started = await self.engine.collective_rpc("forge_stage_packed", kwargs=kwargs)
        if not all(r["staged"] for r in started):  # a model it cannot stage: vLLM reloads it
            return lambda: self._load(path, manifest), False
        while None in (staged := await self.engine.collective_rpc("forge_staged")):
            await asyncio.sleep(STAGE_POLL_S)
        if errors := [r["error"] for r in staged if "error" in r]:
            raise WeightVersionError(errors[0])
        verify_s = max(r["verify_s"] for r in staged)
        return lambda: self._swap(self._swap_staged(), verify_s), True

    async def _swap(self, swap: Awaitable[Any], verify_s: float) -> float:
        await swap
        return verify_s

    async def _swap_staged(self) -> None:
        results = await self.engine.collective_rpc("forge_swap_staged")
        if errors := [r["error"] for r in results if "error" in r]:
            raise WeightVersionError(errors[0])

    def _write_adapter(self, path: Path, manifest: Manifest) -> tuple[Path, float]:
        """Verifies the pinned adapter version and writes it as a PEFT folder; the folder and
        the verification's seconds. Raises WeightVersionError if the bytes are not the
        manifest's."""
        start = time.perf_counter()
        with open_version(path, manifest) as tensors:
            verified = time.perf_counter()
            return self.adapter.write(manifest.version, tensors), verified - start

    async def _load(self, path: Path, manifest: Manifest) -> float:
        """Has the engine verify and load the pinned file; returns its verification seconds."""
        kwargs = {"path": str(path), "manifest_json": manifest.to_json()}
        results = await self.engine.collective_rpc("forge_load_packed", kwargs=kwargs)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise WeightVersionError(errors[0])
        return max(r["verify_s"] for r in results)
