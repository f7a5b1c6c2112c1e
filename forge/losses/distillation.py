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


def top_k_reverse_kl_loss(
    student_top_logprobs: Tensor,
    teacher_top_logprobs: Tensor,
    mask: Tensor,
    aggregation: Aggregation = "token_mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The reverse KL(student || teacher) at every position, computed, not sampled.

    Both distributions are coarsened to the teacher's top k tokens plus one bucket for the
    rest of the vocabulary (whose teacher mass is 1 - the top k's), and the KL between the two
    (k + 1)-outcome distributions is exact:

        KL_t = sum_i s_i (log s_i - log q_i) + s_rest (log s_rest - log q_rest)

    It never exceeds the full KL (coarsening loses information) and equals it when the student
    and teacher agree on how the rest is split. Unlike `reverse_kl_loss` there is no sampling
    noise at a position: a wrong answer token the student rarely samples is still pushed down.
    The positions themselves come from the student's samples (on-policy states).

    Args:
        student_top_logprobs: [batch, seq, k] the student's logprobs of the teacher's top k
            tokens, with grad.
        teacher_top_logprobs: [batch, seq, k] the teacher's logprobs of the same tokens.
        mask: [batch, seq] the response positions.
        aggregation, norm_length: as in forge.losses.aggregation.aggregate.

    Returns:
        (loss, metrics): the loss is the aggregated KL; metrics["reverse_kl"] its token mean and
        metrics["teacher_top_k_mass"] the teacher's mean probability on its top k (how much of
        the distribution the coarsening keeps).
    """
    mask = mask.bool()
    # Padding may hold anything (NaN included): it must reach neither the loss nor the gradient.
    keep = mask[..., None]
    s = torch.where(keep, student_top_logprobs.float(), -1.0)
    q = torch.where(keep, teacher_top_logprobs.float(), -1.0)
    s_rest_log, q_rest_log = _log_rest(s), _log_rest(q)
    per_token = (s.exp() * (s - q)).sum(-1) + s_rest_log.exp() * (s_rest_log - q_rest_log)
    per_token = torch.where(mask, per_token, 0.0)
    loss = aggregate(per_token, mask, aggregation, norm_length)
    metrics = {
        "loss": loss,
        "reverse_kl": masked_mean(per_token, mask),
        "teacher_top_k_mass": masked_mean(q.exp().sum(-1), mask),
    }
    return loss, {name: value.detach() for name, value in metrics.items()}


def _log_rest(top_logprobs: Tensor) -> Tensor:
    """log(1 - the top k's probability), kept finite when rounding puts their sum at 1."""
    return torch.log1p(-top_logprobs.exp().sum(-1).clamp(max=1.0 - 1e-6))
