"""Generator: a vLLM async engine in an actor, producing Completions with per-token versions.

    gen = await Generator.options(num_replicas=2).as_service(GeneratorConfig(), WeightSyncConfig())
    completions = await gen.generate.route("What is 2+3?", n=8)
    await gen.update_weights.fanout(version)

The engine core runs in its own process (vLLM's AsyncLLM), so the actor's event loop stays free
to accept requests and weight updates while it generates. The actor holds the engine and its
two layers: the request layer (`requests.py`) and the weight-update controller
(`weight_updates.py`), which fetches and verifies a new version while generation goes on and
pauses the engine only for the swap, in one of three modes (docs/architecture.md).
"""

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

from monarch.actor import endpoint
from monarch.actor.concurrent import concurrent_endpoint

from forge.actors.generator.adapter import AdapterSlot
from forge.actors.generator.busy import BusySpans, Purpose
from forge.actors.generator.config import GeneratorConfig, check_update_mode
from forge.actors.generator.requests import Requests
from forge.actors.generator.weight_updates import WeightUpdates
from forge.actors.vllm import vllm_compat
from forge.actors.vllm.engine import checkpoint_shapes, start_engine
from forge.actors.vllm.engine_stats import EngineStats
from forge.controller import ForgeActor, retry_safe
from forge.data.completion import Completion
from forge.models.lora import peft_shapes
from forge.observability.startup import phase, record
from forge.placement.cores import move_to_cores, process_cores
from forge.weights.sync_config import WeightSyncConfig

logger = logging.getLogger(__name__)


class Generator(ForgeActor):
    """Generates Completions with vLLM; swaps weights without losing a request.

    Args:
        cfg: the engine, its sampling defaults and its update mode.
        weight_sync: the run's weight-sync section: the engine's dtype, the LoRA adapter it
            serves (if versions are adapters), and the transport versions come through.
    """

    def __init__(
        self, cfg: GeneratorConfig | None = None, weight_sync: WeightSyncConfig | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg or GeneratorConfig()
        self.weight_sync = weight_sync or WeightSyncConfig()
        self._stats = EngineStats()
        self._busy = BusySpans()
        self.engine: Any = None
        self.updates: WeightUpdates | None = None

    @endpoint
    async def setup(self) -> None:
        """Starts the engine on the configured model."""
        from forge.models import resolve_model

        path = resolve_model(self.cfg.model)
        sync = self.weight_sync
        with phase("Generator", "vllm import"):
            vllm_compat.preload_engine_cores()
            import vllm.v1.engine.async_llm  # noqa: F401
        starting = time.time()
        self.engine = start_engine(self.cfg, sync, path, stat_loggers=[self._stats.factory])
        await self.engine.collective_rpc("forge_die_with_parent")
        # Split where the engine core's process began: the engine's config in this process,
        # then that process's imports, weights load, memory profile and warm-up.
        core = min(await self.engine.collective_rpc("forge_process_started"))
        record("Generator", "engine config", starting, core)
        record("Generator", "engine core start", core, time.time())
        shapes, adapter = checkpoint_shapes(path), None
        if (lora := sync.served_adapter()) is not None:  # versions are adapters for this model
            shapes = peft_shapes(lora, shapes)
            adapter = AdapterSlot(lora, path, shapes)
        self.updates = WeightUpdates(self.engine, self.cfg, sync.transport, shapes, adapter)
        with phase("Generator", "weight updates start"):
            await self.updates.start()
        self.requests = Requests(
            self.engine,
            self.engine.tokenizer,
            self.cfg,
            lambda: self.updates.aborting_swaps,
            lambda: adapter and adapter.request,
            lambda: self.updates.aborting,
            self.updates.settled,
        )

    @property
    def version(self) -> int:
        return self.updates.version

    @concurrent_endpoint
    @retry_safe
    async def generate(
        self,
        prompt: str | list[dict[str, str]] | list[int],
        n: int | None = None,
        sampling: dict[str, Any] | None = None,
        purpose: Purpose = "rollout",
    ) -> list[Completion]:
        """Samples `n` completions of a prompt: text, chat messages or token ids.

        Chat messages get the model's chat template. `sampling` overrides SamplingConfig fields.
        `purpose` labels the call's time on the run's timeline (`busy_spans`).
        """
        with self._busy.busy(purpose), self._ends_with_the_engine():
            return await self.requests.generate(prompt, n, sampling)

    @concurrent_endpoint
    @retry_safe
    async def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """The logprob of each token of `prompt_ids` given the ones before it, under the
        weights this generator serves (None for the first token, which nothing predicts)."""
        with self._busy.busy("rollout"), self._ends_with_the_engine():
            return await self.requests.prompt_logprobs(prompt_ids)

    @contextlib.contextmanager
    def _ends_with_the_engine(self) -> Iterator[None]:
        """A dead engine makes this a dead replica: the process ends before the failed call's
        error is sent, so the service sees a dead replica (retries its calls elsewhere, leaves
        it out of a fanout, respawns it) instead of an error from every call from now on."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            yield
        except EngineDeadError as error:
            logger.error("vLLM engine died (%s): ending this generator process", error)
            os.kill(os.getpid(), signal.SIGKILL)
            raise

    # Concurrent, as generate is: while an update drains, the actor still answers health
    # checks, stats and metric pulls (the update controller runs one update at a time).
    @concurrent_endpoint
    async def update_weights(self, version: int, mode: str | None = None) -> dict[str, Any]:
        """Loads weight `version` from the transport; generation pauses only for the swap, and
        `generate` calls made meanwhile wait for it, to generate on `version`.

        `mode` overrides the configured update mode for this update. If the version is missing,
        incomplete or corrupted, raises WeightVersionError and keeps serving the current
        weights. Returns the mode used and the fetch, pause and swap times in seconds.
        """
        if mode is not None:
            check_update_mode(mode)
        with self._ends_with_the_engine():
            return await self.updates.update(version, mode or self.cfg.update_mode)

    @concurrent_endpoint
    async def load_latest(self) -> int:
        """Loads the newest complete version in the transport (a respawned replica catching up).

        A version deleted before it could be loaded gives way to the newer one that replaced it,
        until `transport.fetch_timeout_s` has passed.
        """
        with self._ends_with_the_engine():
            return await self.updates.load_latest(self.cfg.update_mode)

    @endpoint
    async def loaded_checksum(self, name: str) -> str:
        """The manifest checksum of parameter `name` (HF name) as the engine holds it now: which
        weights it really serves. Parameters vLLM fuses or re-packs (qkv, CPU linear layers)
        differ from their checkpoint form; the input embedding does not."""
        with self._ends_with_the_engine():
            (result,) = await self.engine.collective_rpc("forge_checksum", args=(name,))
        return result

    @endpoint
    async def get_version(self) -> int:
        return self.version

    @endpoint
    async def use_cores(self, cpus: list[int]) -> list[int]:
        """Moves this actor and its engine's process onto `cpus`, with as many threads."""
        mine = move_to_cores(cpus)
        await self.engine.collective_rpc("forge_use_cores", args=(cpus,))
        return mine

    @endpoint
    async def cores(self) -> dict[str, Any]:
        """This actor's pid and cores, and its engine's (`engine`), with thread counts."""
        import torch

        [engine] = await self.engine.collective_rpc("forge_cores")
        return {**process_cores(torch.get_num_threads()), "engine": engine}

    @endpoint
    async def busy_spans(self) -> list[tuple[str, float, float]]:
        """The intervals this generator had calls of one purpose running, since the last call:
        (purpose, start, end) on the wall clock."""
        return self._busy.take()

    @endpoint
    async def stats(self) -> dict[str, float]:
        """Engine statistics: tokens/s since the last call, running and waiting requests, KV use."""
        return self._stats.snapshot()

    async def __cleanup__(self, exc: Exception | None) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.updates is not None:
            self.updates.close()
