"""The trainer's configuration: the model, its optimiser and schedule, and its objective (where
its weights go is the run's weight_sync section, forge.weights.sync_config)."""

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from forge.actors.trainer.checkpoint_folder import CheckpointConfig
from forge.config import at_least, field_error, positive, require
from forge.losses import OBJECTIVES, LossConfig, ObjectiveName
from forge.models import check_model
from forge.models.titan import LOGITS_CHUNK_TOKENS


@dataclass
class OptimizerConfig:
    """AdamW's settings.

    Args:
        lr: the learning rate; trainer.scheduler scales it each step.
        betas: the decay rates of the running means of the gradient and of its square.
        eps: added to the denominator of each update, for numerical stability.
        weight_decay: decoupled weight decay (0: none).
    """

    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        positive(self, "lr", "eps")
        at_least(self, 0, "weight_decay")
        require(self, "betas", _decay_rates, "two decay rates in [0, 1)")


def _decay_rates(betas: list[float]) -> bool:
    return len(betas) == 2 and all(0 <= b < 1 for b in betas)


@dataclass
class SchedulerConfig:
    """Linear warm-up over `warmup_steps`, then `decay` to lr * min_lr_ratio over `decay_steps`.

    Args:
        warmup_steps: steps over which the learning rate rises linearly to lr (0: none).
        decay: "constant" (no decay), "linear" or "cosine", after the warm-up.
        decay_steps: steps the decay takes; lr * min_lr_ratio after them (0: no decay).
        min_lr_ratio: where the decay ends, as a fraction of lr.
    """

    warmup_steps: int = 0
    decay: Literal["constant", "linear", "cosine"] = "constant"
    decay_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        at_least(self, 0, "warmup_steps", "decay_steps")
        require(self, "min_lr_ratio", lambda r: 0 <= r <= 1, "in [0, 1]")


@dataclass
class GuardConfig:
    """The divergence guard: what happens to a step that blows up (a non-finite loss or
    gradient norm, or a gradient norm above `grad_norm_ratio` times the median of the last
    `window` applied steps', once there are `window`).

    Args:
        action: "skip": the step is not applied (weights, optimizer state and schedule stay as
            they were) and the run goes on; "stop": not applied, and the run ends; "off":
            every step is applied. The console names the step and its replay command.
        grad_norm_ratio: how many times the running median a gradient norm may reach.
        window: the applied steps the median is taken over.
    """

    action: Literal["skip", "stop", "off"] = "skip"
    grad_norm_ratio: float = 10.0
    window: int = 20

    def __post_init__(self) -> None:
        if self.grad_norm_ratio <= 1.0 or self.window < 1:
            raise ValueError(
                f"need grad_norm_ratio > 1 and window >= 1, got {self.grad_norm_ratio}, "
                f"{self.window}"
            )


# The fields of TrainerConfig that change how a batch trains, not what a batch is: a replay may
# change them (`forge replay RUN --step N trainer.loss.clip_eps=0.1`).
OPTIMISATION_FIELDS = ("loss", "optimizer", "scheduler", "max_grad_norm", "guard")


@dataclass
class TrainerConfig:
    """The model, its optimisation and its objective.

    Args:
        model: a name `forge.models.resolve_model` knows, or a local HF checkpoint folder.
        objective: a name in forge.losses.OBJECTIVES: "grpo" (policy gradient on
            advantages), "distill" (reverse KL to teacher_logprobs) or "sft" (cross-entropy on
            the completion tokens). An app's config sets it (RunConfig.OBJECTIVE), no yaml key.
        temperature: the generator's sampling temperature; logprobs are taken at it.
        dtype: "float32", or "bfloat16" compute over float32 weights, gradients and optimizer
            state: FSDP's mixed precision on GPUs, autocast on CPUs (where FSDP's per-unshard
            casts made a step slower than float32).
        max_grad_norm: the gradient norm is clipped to this before each step.
        tensor_parallel: tensor-parallel degree (GPU); the data-parallel degree is the rest.
        seed: seeds torch on each rank (seed + rank) and the LoRA adapters' initial values.
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
        optimizer: AdamW's settings (OptimizerConfig).
        scheduler: the learning rate's warm-up and decay (SchedulerConfig).
        loss: the loss's clipping, KL, importance-sampling correction and aggregation
            (LossConfig).
        guard: what happens to a step that blows up (GuardConfig).
        checkpoint: whether and how often the trainer checkpoints (CheckpointConfig).

    Whether it trains LoRA adapters, what a published version holds (its dtype, the adapters
    or the full weights) and the transport it goes through are the run's `weight_sync`
    section (WeightSyncConfig), which the trainer receives beside this config.
    """

    model: str = "SmolLM2-135M-Instruct"
    objective: ObjectiveName = "grpo"
    temperature: float = 1.0
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_grad_norm: float = 1.0
    tensor_parallel: int = 1
    seed: int = 0
    exact_mismatch: bool = True  # keep the previous weights to measure the mismatch KL exactly
    exact_mismatch_sample: float = 0.05
    micro_batch_size: int = 0
    logits_chunk_tokens: int = LOGITS_CHUNK_TOKENS
    activation_checkpointing: Literal["none", "full"] = "none"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "transport": "moved to weight_sync.transport (one section for the trainer and the "
        "generators)",
        "publish_dtype": "moved to weight_sync.dtype (the generators' dtype, which versions hold)",
        "lora": "moved to weight_sync.lora (what the trainer trains is what the generators serve)",
        "objective": "set by the app (its Config.OBJECTIVE): remove it",
    }

    def __post_init__(self) -> None:
        require(self, "model", bool, "a model name or folder")
        positive(self, "temperature", "max_grad_norm")
        at_least(self, 1, "tensor_parallel")
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

    def check_available(self) -> None:
        """Raises FieldError unless `model` resolves on this machine (nothing is built)."""
        with field_error("model"):
            check_model(self.model)


def lr_factor(cfg: SchedulerConfig, step: int) -> float:
    """The learning-rate multiplier at `step` (warm-up, then decay to min_lr_ratio)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant" or cfg.decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
    shape = 1 - progress if cfg.decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape
