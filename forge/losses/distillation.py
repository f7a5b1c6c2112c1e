"""On-policy distillation: the student samples, the teacher scores each sampled token, and the
student minimises the reverse KL to the teacher on its own samples (GKD, Agarwal et al. 2024;
"On-Policy Distillation", Thinking Machines 2025)."""

import torch
from torch import Tensor

from forge.losses.aggregation import Aggregation, aggregate, masked_mean


def reverse_kl_loss(
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    aggregation: Aggregation = "token_mean",
    norm_length: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE loss whose gradient estimates that of the reverse KL(student || teacher).

    Per token, with s = student and q = teacher, and y_t sampled from s:

        KL(s || q) = E_{y~s}[log s(y) - log q(y)]
        grad KL    = E_{y~s}[(log s(y) - log q(y)) grad log s(y)]   (E_s[grad log s] = 0)

    so the loss is -A_t log s(y_t) with the per-token advantage A_t = -(log s_t - log q_t),
    detached. Each token is credited with its own KL only, not that of the tokens after it (a
    discount of 0, as in Thinking Machines' recipe): for the sequence-level KL this is biased,
    but of much lower variance. The tokens are assumed to come from the student; for tokens
    from a lagging generator pass `is_weights` (e.g. truncated pi_theta / mu, detached).

    Args:
        logprobs: [batch, seq] the student's log-probabilities of the sampled tokens, with grad.
        teacher_logprobs: [batch, seq] the teacher's log-probabilities of the same tokens.
        mask: [batch, seq] bool or 0/1, the response tokens.
        aggregation, norm_length: as in forge.losses.aggregation.aggregate.
        is_weights: [batch, seq] per-token importance weights, or None for 1.

    Returns:
        (loss, metrics). The loss's value is not the KL; metrics["reverse_kl"] is: the token mean
        of log s - log q (the unbiased k1 estimate), detached. metrics["loss"] is the loss.
    """
    mask = mask.bool()
    log_ratio = torch.where(mask, logprobs - teacher_logprobs, 0.0)
    advantages = -log_ratio.detach()
    per_token = -advantages * torch.where(mask, logprobs, 0.0)
    metrics = {"reverse_kl": masked_mean(log_ratio, mask)}
    if is_weights is not None:
        per_token = is_weights.detach() * per_token
        metrics["is_weight_mean"] = masked_mean(is_weights, mask)
    loss = aggregate(per_token, mask, aggregation, norm_length)
    metrics["loss"] = loss
    return loss, {name: value.detach() for name, value in metrics.items()}
