"""GRPO policy loss: PPO-clipped ratio with asymmetric bounds, optional KL to a reference and
optional importance-sampling correction of the generator/trainer mismatch."""

import torch
from torch import Tensor

from forge.losses.aggregation import aggregate, masked_mean
from forge.losses.config import LossConfig
from forge.losses.importance import masked_is_weights, mismatch_kl, truncated_is_weights
from forge.losses.kl import kl_k3


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    behaviour_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO loss to minimise, and detached 0-dim metrics.

    Per valid token t, with r_t = exp(logprobs_t - old_logprobs_t) and advantage A_t:

        L_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) + beta * k3_t

    where k3_t estimates KL(pi_theta || pi_ref) (forge.losses.kl) and w_t is the IS weight
    (1 without correction). Where the clipped branch is the smaller (r_t > 1 + eps_high with
    A_t > 0, r_t < 1 - eps_low with A_t < 0) the token has no policy gradient; at exactly a bound
    both branches agree and the gradient flows. L_t is aggregated per `cfg.aggregation` over the
    valid tokens (minus those MIS drops).

    `old_logprobs` is both the clip anchor and the proximal policy of the IS ratio
    rho = exp(old_logprobs - behaviour_logprobs) (forge.losses.importance). Three setups:

    - Decoupled: old_logprobs = the trainer's logprobs recomputed under the parameters that
      generated; behaviour_logprobs = the generator's. The clip bounds the policy's move, TIS/MIS
      correct the trainer/generator mismatch.
    - Fresh data, no recompute: old_logprobs=None means logprobs.detach() (the current parameters
      generated). r_t = 1 in value, so the clip never binds and the loss is the plain policy
      gradient weighted by w_t; rho is the mismatch between trainer and generator.
    - Plain async: old_logprobs = behaviour_logprobs = the generator's. r_t = pi_theta / mu is
      itself the (clipped) IS ratio against the generator; TIS/MIS would do nothing (rho = 1),
      so leave is_correction "none".

    Args:
        logprobs: [batch, seq] log pi_theta of the sampled tokens, with gradient.
        old_logprobs: [batch, seq] clip anchor / proximal logprobs (detached here), or None.
        advantages: [batch] per sequence, or [batch, seq] per token.
        mask: [batch, seq] bool or 0/1, the response tokens. Other positions may hold anything.
        cfg: the loss settings.
        behaviour_logprobs: [batch, seq] the generator's logprobs; needed by TIS/MIS, and gives
            the "mismatch_kl" metric whenever present.
        ref_logprobs: [batch, seq] reference model logprobs; needed when cfg.kl_coef > 0, and
            gives the "kl" metric whenever present.

    Returns:
        (loss, metrics): metrics has "loss", "clip_frac" (share of loss tokens whose clipped
        branch binds), "ratio_mean", and when they apply "kl", "mismatch_kl", "is_weight_mean",
        "mis_masked_frac" (share of valid tokens MIS dropped). Token means, whatever the
        aggregation.
    """
    if cfg.is_correction != "none" and behaviour_logprobs is None:
        raise ValueError(f"is_correction={cfg.is_correction!r} needs behaviour_logprobs")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs")

    mask = mask.bool()
    if advantages.dim() == 1:
        # Per sequence. Without this, [batch] would broadcast along seq, silently, when equal.
        advantages = advantages.unsqueeze(-1)
    # Padding may hold inf or NaN. The masked reductions drop its values, but backward through
    # them still computes 0 * NaN = NaN there; cutting the gradient at the input keeps it out of
    # the model.
    logprobs = torch.where(mask, logprobs, 0.0)
    # A constant anchor: were it to carry gradient, the ratio's gradient would cancel to 0.
    old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs.detach()

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)

    metrics: dict[str, Tensor] = {}
    loss_mask = mask
    if behaviour_logprobs is not None:
        metrics["mismatch_kl"], _ = mismatch_kl(old_logprobs, behaviour_logprobs, mask)
    if cfg.is_correction != "none":
        if cfg.is_correction == "tis":
            weights = truncated_is_weights(old_logprobs, behaviour_logprobs, cfg.tis_cap)
        else:
            weights, keep = masked_is_weights(
                old_logprobs, behaviour_logprobs, cfg.mis_low, cfg.mis_high
            )
            loss_mask = mask & keep
            metrics["mis_masked_frac"] = masked_mean((~keep).float(), mask)
        # Only the policy-gradient term is reweighted; the KL penalty is a regulariser, as is.
        per_token = weights * per_token
        metrics["is_weight_mean"] = masked_mean(weights, loss_mask)

    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs)
        metrics["kl"] = masked_mean(kl, mask)
        per_token = per_token + cfg.kl_coef * kl

    loss = aggregate(per_token, loss_mask, cfg.aggregation, cfg.norm_length)
    metrics["loss"] = loss
    metrics["clip_frac"] = masked_mean((clipped > unclipped).float(), loss_mask)
    metrics["ratio_mean"] = masked_mean(ratio, loss_mask)
    return loss, {name: value.detach() for name, value in metrics.items()}


def sampled_kl_weights(
    cfg: LossConfig, logprobs: Tensor, behaviour_logprobs: Tensor | None
) -> Tensor | None:
    """Per-token weights of a KL estimated on tokens an older generator sampled: TIS's
    min(pi_theta / mu, tis_cap) under "tis", none under "none". MIS would drop tokens from
    the estimate: refused."""
    if cfg.is_correction == "mis":
        raise ValueError("objective 'distill' supports is_correction 'none' or 'tis', not 'mis'")
    if cfg.is_correction == "tis":
        return truncated_is_weights(logprobs, behaviour_logprobs, cfg.tis_cap)
    return None
