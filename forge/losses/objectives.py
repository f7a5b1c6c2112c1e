"""Training objectives by name: what the trainer minimises on one collated batch.

Each objective is a function `(ObjectiveInputs, LossConfig) -> (loss, metrics)`; the trainer
looks it up in OBJECTIVES by the name its config gives, so a new objective is one function and
one entry here, with no change to the trainer.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from forge.losses.aggregation import masked_mean
from forge.losses.config import LossConfig
from forge.losses.distillation import reverse_kl_loss, top_k_reverse_kl_loss
from forge.losses.grpo import grpo_loss, sampled_kl_weights
from forge.losses.sft import sft_loss

ObjectiveName = Literal["grpo", "distill", "sft"]


@dataclass
class ObjectiveInputs:
    """Per-token tensors of one batch, all [batch, seq] but `advantages` ([batch]).

    Attributes:
        logprobs: the trainer's log-probabilities of the tokens, with grad.
        mask: the tokens that carry loss (completion or answer tokens).
        behaviour_logprobs: the generator's log-probabilities of the same tokens.
        advantages: one per sequence.
        ref_logprobs: a reference model's, or None.
        teacher_logprobs: a teacher's, or None.
        teacher_top_logprobs: [batch, seq, k] a teacher's logprobs of its k most likely tokens
            at each position, or None.
        student_top_logprobs: [batch, seq, k] the trainer's of the same tokens, with grad.
    """

    logprobs: Tensor
    mask: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    ref_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    teacher_top_logprobs: Tensor | None = None
    student_top_logprobs: Tensor | None = None


TOP_K_IS_CORRECTION = (
    "distillation from the teacher's top k computes each position's KL exactly, with no "
    "per-token importance weight: set trainer.loss.is_correction to 'none'"
)

Objective = Callable[[ObjectiveInputs, LossConfig], tuple[Tensor, dict[str, Tensor]]]


def grpo_objective(x: ObjectiveInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO. Without an IS correction it clips against the generator's logprobs (plain async
    PPO); with one, the proximal policy is the current one and the generator's logprobs give
    the IS ratio."""
    old = None if cfg.corrects else x.behaviour_logprobs
    loss, metrics = grpo_loss(
        x.logprobs,
        old,
        x.advantages,
        x.mask,
        cfg,
        behaviour_logprobs=x.behaviour_logprobs,
        ref_logprobs=x.ref_logprobs,
    )
    # grpo_loss's mismatch_kl compares against old_logprobs, which are the generator's here:
    # the trainer measures the mismatch itself, under the right weights.
    metrics.pop("mismatch_kl", None)
    return loss, metrics


def distill_objective(x: ObjectiveInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """On-policy distillation: reverse KL to the teacher on the student's own samples.

    With the teacher's top k at each position, the KL there is computed exactly (over the top k
    plus a bucket for the rest) and the positions are taken as they come, also from an older
    generator; the metrics keep the sampled-token estimate as "sampled_reverse_kl". Otherwise
    it is estimated from the sampled tokens, which assumes they were sampled by the weights
    being trained: samples from an older generator (async) are reweighted by TIS,
    min(pi_theta / mu, tis_cap) per token, when `cfg.is_correction` is "tis".
    """
    if x.teacher_logprobs is None:
        raise ValueError("objective 'distill' needs teacher_logprobs on every episode")
    weights = sampled_kl_weights(cfg, x.logprobs.detach(), x.behaviour_logprobs)
    if x.teacher_top_logprobs is not None and x.student_top_logprobs is not None:
        if cfg.corrects:
            raise ValueError(TOP_K_IS_CORRECTION)
        loss, metrics = top_k_reverse_kl_loss(
            x.student_top_logprobs,
            x.teacher_top_logprobs,
            x.mask,
            cfg.aggregation,
            cfg.norm_length,
        )
        sampled = masked_mean(x.logprobs.detach() - x.teacher_logprobs, x.mask.bool())
        return loss, {**metrics, "sampled_reverse_kl": sampled}
    return reverse_kl_loss(
        x.logprobs, x.teacher_logprobs, x.mask, cfg.aggregation, cfg.norm_length, weights
    )


def sft_objective(x: ObjectiveInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Cross-entropy on the masked (answer) tokens."""
    return sft_loss(x.logprobs, x.mask, cfg.aggregation, cfg.norm_length)


# The objective of each ObjectiveName; its keys are get_args(ObjectiveName)
# (tests/unit/test_objectives.py checks it).
OBJECTIVES: dict[ObjectiveName, Objective] = {
    "grpo": grpo_objective,
    "distill": distill_objective,
    "sft": sft_objective,
}
