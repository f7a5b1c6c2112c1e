"""The generator's configuration: its engine, its sampling defaults, how it takes new weights."""

from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from forge.config import FieldError, at_least, field_error, positive, require
from forge.models import check_model

UpdateMode = Literal["drain", "abort", "inflight"]
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)


@dataclass
class SamplingConfig:
    """Default sampling; `generate(..., sampling={...})` overrides fields per call.

    Args:
        n: completions sampled per prompt.
        temperature: the softmax temperature of sampling (the trainer takes logprobs at it).
        top_p: nucleus sampling: only the most likely tokens whose probabilities sum to top_p.
        top_k: only the k most likely tokens; 0: off.
        max_tokens: sampled tokens per completion at most.
        seed: the engine's sampling seed; None: unseeded (a run's rollouts seed each request).
        ignore_eos: keep sampling past the end-of-sequence token, up to max_tokens (benchmarks).
        stop: strings that end a completion (not part of it), besides the end-of-sequence token.
        stop_token_ids: tokens that end a completion (part of it), likewise.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        at_least(self, 1, "n", "max_tokens")
        at_least(self, 0, "temperature", "top_k")
        require(self, "top_p", lambda p: 0 < p <= 1, "in (0, 1]")


@dataclass
class GeneratorConfig:
    """The engine, its sampling defaults, and how it takes new weights.

    Args:
        model: a name `forge.models.resolve_model` knows, or a local HF checkpoint folder.
        max_model_len: the engine's context: prompt plus completion tokens of one sequence.
        max_num_seqs: sequences the engine runs at once; more wait in its queue.
        kv_cache_mb: KV cache size; None lets vLLM size it from `gpu_memory_utilization`.
        gpu_memory_utilization: the share of a GPU's memory the engine may take (vLLM's).
        tensor_parallel_size: GPUs one engine's model is split over (vLLM's tensor parallelism).
        enforce_eager: run the model eagerly, without compiling it or capturing CUDA graphs.
        update_mode: "drain" (default), "abort" or "inflight" (docs/architecture.md).
        drain_timeout_s: a drain that takes longer falls back to "abort".
        inflight_recompute_kv: in "inflight" mode, recompute the KV cache of paused sequences
            with the new weights (vLLM's clear_cache) instead of keeping the old one.
        sampling: the sampling defaults of every request (SamplingConfig).

    The engine's dtype, the LoRA adapter it serves and the transport new weights come
    through are the run's `weight_sync` section (WeightSyncConfig), which the generator
    receives beside this config.
    """

    model: str = "SmolLM2-135M-Instruct"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    kv_cache_mb: int | None = 512
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    update_mode: UpdateMode = "drain"
    drain_timeout_s: float = 30.0
    inflight_recompute_kv: bool = False
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "transport": "moved to weight_sync.transport (one section for the trainer and the "
        "generators)",
        "dtype": "moved to weight_sync.dtype (the engine's dtype, which versions are published in)",
        "lora": "moved to weight_sync.lora (set once: the generators serve what the trainer "
        "trains)",
    }

    def __post_init__(self) -> None:
        require(self, "model", bool, "a model name or folder")
        at_least(self, 1, "max_model_len", "max_num_seqs", "kv_cache_mb", "tensor_parallel_size")
        require(self, "gpu_memory_utilization", lambda u: 0 < u <= 1, "in (0, 1]")
        positive(self, "drain_timeout_s")
        if self.sampling.max_tokens >= self.max_model_len:
            raise FieldError(
                "sampling.max_tokens",
                f"must be < max_model_len {self.max_model_len}, got {self.sampling.max_tokens}: "
                "a prompt needs room in the context too",
            )
        # The yaml loader checks the Literal; this catches a config built in Python.
        check_update_mode(self.update_mode)

    def check_available(self) -> None:
        """Raises FieldError unless `model` resolves on this machine (nothing is built)."""
        with field_error("model"):
            check_model(self.model)


def check_update_mode(mode: str) -> None:
    """Raises ValueError unless `mode` is one of UPDATE_MODES."""
    if mode not in UPDATE_MODES:
        raise ValueError(f"update mode must be one of {UPDATE_MODES}, got {mode!r}")
