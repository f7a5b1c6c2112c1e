"""Losses for RL post-training: plain functions on per-token [batch, seq] tensors, no Monarch."""

from forge.losses.advantages import group_advantages
from forge.losses.aggregation import AGGREGATIONS, Aggregation, aggregate, masked_mean, masked_sum
from forge.losses.config import IS_CORRECTIONS, ISCorrection, LossConfig
from forge.losses.distillation import reverse_kl_loss, top_k_reverse_kl_loss
from forge.losses.grpo import grpo_loss
from forge.losses.importance import (
    importance_ratio,
    masked_is_weights,
    mismatch_kl,
    truncated_is_weights,
)
from forge.losses.kl import kl_k1, kl_k2, kl_k3
from forge.losses.objectives import OBJECTIVES, Objective, ObjectiveInputs, ObjectiveName
from forge.losses.sft import sft_loss

__all__ = [
    "AGGREGATIONS",
    "IS_CORRECTIONS",
    "Aggregation",
    "OBJECTIVES",
    "Objective",
    "ObjectiveInputs",
    "ObjectiveName",
    "LossConfig",
    "ISCorrection",
    "aggregate",
    "grpo_loss",
    "group_advantages",
    "importance_ratio",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "masked_is_weights",
    "masked_mean",
    "masked_sum",
    "mismatch_kl",
    "reverse_kl_loss",
    "sft_loss",
    "top_k_reverse_kl_loss",
    "truncated_is_weights",
]
