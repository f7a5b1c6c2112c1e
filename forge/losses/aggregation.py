"""Masked reductions over per-token tensors, and the loss aggregation modes.

Every tensor is [batch, seq] over response tokens; `mask` (bool or 0/1 float, same shape) marks
the real response tokens. Positions outside the mask never reach a value, even if they hold
inf or NaN (padding often does), because they are selected away with `torch.where` rather than
multiplied by 0 (0 * inf = NaN). Their gradient is 0 here, but a NaN-safe gradient also needs
the differentiated input zeroed there (see grpo_loss).

These reduce over the tensors they are given. Under gradient accumulation or data parallelism
the normaliser (token count, sequence count) is that of the micro-batch.
"""

from typing import Literal, get_args

import torch
from torch import Tensor

Aggregation = Literal["token_mean", "sequence_mean", "sequence_sum_norm"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum_i m_i x_i over all elements (dim=None) or along `dim`."""
    x = torch.where(mask.bool(), x, 0.0)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum_i m_i x_i / sum_i m_i; 0 where no element is valid (not NaN)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def aggregate(
    per_token: Tensor, mask: Tensor, mode: Aggregation, norm_length: int | None = None
) -> Tensor:
    """Reduce a per-token loss [batch, seq] to a scalar.

    With B sequences, T_b valid tokens in sequence b and loss l_{b,t}:

    - "token_mean":        sum_{b,t} l_{b,t} / sum_b T_b. Every token weighs the same, so long
                           sequences dominate (DAPO's token-level loss).
    - "sequence_mean":     mean_b (sum_t l_{b,t} / T_b), over sequences with T_b > 0. Every
                           sequence weighs the same, so a token in a short sequence weighs more
                           (the original GRPO loss).
    - "sequence_sum_norm": sum_{b,t} l_{b,t} / (B * L), L a constant (`norm_length`, default the
                           padded length seq). Neither length bias (Dr. GRPO); L should be the
                           generation budget so the scale does not change with the padding.
    """
    mask = mask.bool()
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "sequence_mean":
        per_sequence = masked_mean(per_token, mask, dim=-1)
        # An empty sequence (no response tokens) has no mean; it must not dilute the others.
        return masked_mean(per_sequence, mask.any(dim=-1))
    if mode == "sequence_sum_norm":
        length = per_token.shape[-1] if norm_length is None else norm_length
        return masked_sum(per_token, mask) / (per_token.shape[0] * length)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
