"""ReferenceModel: a frozen model that scores completions, for the KL term or as a teacher.

Two backends compute the same numbers, log p(token | everything before it):
    titan  a torchtitan forward pass in this process, padded batches of `max_batch` sequences.
    vllm   a vLLM engine asked for prompt logprobs (forge.actors.vllm.scorer): faster on a
           serving stack, temperature 1 only (vLLM's prompt logprobs are raw).

As a teacher it can also return, at every completion position, its k most likely tokens
(`top_logprobs`), from which the trainer computes each position's KL without sampling.
"""

from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from monarch.actor import endpoint

from forge.actors.vllm.scorer import TopLogprobs, VLLMScorer, check_temperature
from forge.config import at_least, field_error, positive, require
from forge.controller import ForgeActor, retry_safe
from forge.controller.compute_thread import ComputeThread
from forge.data.collate import first_position, gather_tokens, pad_sequences
from forge.models import check_model, resolve_model, titan

# How the frozen model computes its logprobs (module docstring).
Backend = Literal["titan", "vllm"]
BACKENDS: tuple[str, ...] = get_args(Backend)


@dataclass
class ReferenceConfig:
    """The frozen model, and the temperature its logprobs are taken at (the generator's).

    Args:
        model: a name `forge.models.resolve_model` knows, or a local HF checkpoint folder.
        temperature: the temperature its logprobs are taken at: the generator's sampling one.
        backend: "titan" (a torchtitan forward pass) or "vllm" (a vLLM engine's prompt
            logprobs; temperature must be 1.0).
        max_batch: titan: sequences per forward pass, bounds memory; vllm: unused (the
            engine schedules every pair at once, up to `max_num_seqs`).
        max_model_len, max_num_seqs, kv_cache_mb: vllm engine settings.
    """

    model: str = "SmolLM2-135M-Instruct"
    temperature: float = 1.0
    max_batch: int = 16
    backend: Backend = "titan"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    kv_cache_mb: int | None = 256

    def __post_init__(self) -> None:
        require(self, "model", bool, "a model name or folder")
        positive(self, "temperature")
        at_least(self, 1, "max_batch", "max_model_len", "max_num_seqs", "kv_cache_mb")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "vllm":
            check_temperature(self.temperature)

    def check_available(self) -> None:
        """Raises FieldError unless `model` resolves on this machine (nothing is built)."""
        with field_error("model"):
            check_model(self.model)


class ReferenceModel(ForgeActor):
    """Per-token logprobs of completion tokens under fixed weights (never the full logits)."""

    def __init__(self, cfg: ReferenceConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or ReferenceConfig()
        self.scorer: VLLMScorer | None = None
        self.model: Any = None
        self.compute = ComputeThread("forge-reference")  # one OpenMP pool

    @endpoint
    async def setup(self) -> None:
        cfg = self.cfg
        if cfg.backend == "vllm":
            self.scorer = VLLMScorer(
                cfg.model,
                temperature=cfg.temperature,
                max_model_len=cfg.max_model_len,
                max_num_seqs=cfg.max_num_seqs,
                kv_cache_mb=cfg.kv_cache_mb,
            )
            await self.scorer.start()
            return
        self.model = await self.compute.run(titan.load_pretrained, resolve_model(cfg.model))
        self.model.requires_grad_(False)

    @endpoint
    @retry_safe
    async def logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """For each (prompt ids, completion ids): the logprob of every completion token."""
        if self.scorer is not None:
            return await self.scorer.logprobs(pairs)
        return await self.compute.run(self._logprobs, pairs)

    @endpoint
    @retry_safe
    async def top_logprobs(
        self, pairs: list[tuple[list[int], list[int]]], k: int
    ) -> list[TopLogprobs]:
        """For each (prompt ids, completion ids): the logprob of every completion token and, at
        each completion position, the k most likely tokens with their logprobs."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if self.scorer is not None:
            return await self.scorer.top_logprobs(pairs, k)
        return await self.compute.run(self._top_logprobs, pairs, k)

    def _top_logprobs(self, pairs: list[tuple[list[int], list[int]]], k: int) -> list[TopLogprobs]:
        out: list[TopLogprobs] = []
        for start in range(0, len(pairs), self.cfg.max_batch):
            input_ids, mask = pad_sequences(pairs[start : start + self.cfg.max_batch])
            actual, ids, values = titan.top_logprobs(self.model, input_ids, k, self.cfg.temperature)
            for i in range(mask.shape[0]):
                row = mask[i]
                out.append(
                    TopLogprobs(
                        actual[i, row].tolist(), ids[i, row].tolist(), values[i, row].tolist()
                    )
                )
        return out

    def _logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        out: list[list[float]] = []
        for start in range(0, len(pairs), self.cfg.max_batch):
            input_ids, mask = pad_sequences(pairs[start : start + self.cfg.max_batch])
            with torch.no_grad():
                logprobs = titan.token_logprobs(
                    self.model, input_ids, self.cfg.temperature, first=first_position(mask)
                )
            out.extend(gather_tokens(logprobs, mask))
        return out

    async def __cleanup__(self, exc: Exception | None) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
