"""The trainer's configuration: the model, its optimiser and schedule, its objective, and where
its weights go."""

import math
from dataclasses import dataclass, field
from typing import Literal

from forge.actors.checkpointing import CheckpointConfig
from forge.losses import OBJECTIVES, GRPOConfig, ObjectiveName
from forge.models.lora import LoRAConfig
from forge.models.titan import LOGITS_CHUNK_TOKENS
from forge.weights.transport import TransportConfig


@dataclass
class OptimizerConfig:
    """AdamW's settings."""

    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class SchedulerConfig:
    """Linear warm-up over `warmup_steps`, then `decay` to lr * min_lr_ratio over `decay_steps`."""

    warmup_steps: int = 0
    decay: Literal["constant", "linear", "cosine"] = "constant"
    decay_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class TrainerConfig:
    """The model, its optimisation, its objective, and where its weights go.

    Args:
        objective: a name in forge.losses.OBJECTIVES: "grpo" (policy gradient on
            advantages), "distill" (reverse KL to teacher_logprobs) or "sft" (cross-entropy on
            the completion tokens).
        temperature: the generator's sampling temperature; logprobs are taken at it.
        dtype: "float32", or "bfloat16" compute over float32 weights, gradients and optimizer
            state: FSDP's mixed precision on GPUs, autocast on CPUs (where FSDP's per-unshard
            casts made a step slower than float32).
        publish_dtype: the dtype published versions hold: the generators' (a run sets it to
            generator.dtype), so a bfloat16 engine gets half the bytes, already rounded as its
            loader would round them. None: the parameters' own.
        tensor_parallel: tensor-parallel degree (GPU); the data-parallel degree is the rest.
        exact_mismatch: keep a copy of the weights before each step, so one-version-old
            episodes can be scored under the weights that generated them.
        exact_mismatch_sample: the fraction of one-version-old sequences scored so (at least
            one): a forward pass of them, plus swapping the weights in and out. The default
            scores a small sample: enough to estimate the mismatch, at a small part of a step's
            cost; 1.0 scores them all.
        micro_batch_size: sequences per forward and backward pass on a rank; gradients
            accumulate over a rank's batch, so the step equals one pass over it. 0: the whole
            batch at once. Bounds activation memory.
        logits_chunk_tokens: tokens (sequences x positions) whose vocabulary logits exist at
            once; logits are recomputed in the backward pass. Bounds logit memory.
        activation_checkpointing: "full" recomputes each transformer block in the backward
            pass instead of keeping its activations (torchtitan's full AC): less memory for
            about a third more compute.
        lora: train LoRA adapters on the frozen model instead of the model itself
            (forge.models.lora): only adapters hold gradients and optimizer state, checkpoints
            hold them alone, and each published version is the adapters in PEFT's layout (or,
            with `lora.publish: merged`, the weights with them folded in). None: full
            fine-tuning.
    """

    model: str = "SmolLM2-135M-Instruct"
    objective: ObjectiveName = "grpo"
    temperature: float = 1.0
    dtype: Literal["float32", "bfloat16"] = "float32"
    publish_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    max_grad_norm: float = 1.0
    tensor_parallel: int = 1
    seed: int = 0
    exact_mismatch: bool = True  # keep the previous weights to measure the mismatch KL exactly
    exact_mismatch_sample: float = 0.05
    micro_batch_size: int = 0
    logits_chunk_tokens: int = LOGITS_CHUNK_TOKENS
    activation_checkpointing: Literal["none", "full"] = "none"
    lora: LoRAConfig | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    loss: GRPOConfig = field(default_factory=GRPOConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        # Literal fields are checked by the config loader; this guards direct construction.
        if self.objective not in OBJECTIVES:
            known = sorted(OBJECTIVES)
            raise ValueError(f"objective must be one of {known}, got {self.objective!r}")
        if not 0.0 < self.exact_mismatch_sample <= 1.0:
            raise ValueError(
                f"exact_mismatch_sample must be in (0, 1], got {self.exact_mismatch_sample}"
            )
        if self.micro_batch_size < 0 or self.logits_chunk_tokens < 1:
            raise ValueError(
                "need micro_batch_size >= 0 and logits_chunk_tokens >= 1, got "
                f"{self.micro_batch_size} and {self.logits_chunk_tokens}"
            )


def lr_factor(cfg: SchedulerConfig, step: int) -> float:
    """The learning-rate multiplier at `step` (warm-up, then decay to min_lr_ratio)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant" or cfg.decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
    shape = 1 - progress if cfg.decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape
