"""GRPO policy loss: PPO-clipped ratio with asymmetric bounds, optional KL to a reference and
optional importance-sampling correction of the generator/trainer mismatch."""

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from forge.losses.aggregation import AGGREGATIONS, Aggregation, aggregate, masked_mean
from forge.losses.importance import masked_is_weights, mismatch_kl, truncated_is_weights
from forge.losses.kl import kl_k3

ISCorrection = Literal["none", "tis", "mis"]
IS_CORRECTIONS: tuple[str, ...] = get_args(ISCorrection)


@dataclass
class GRPOConfig:
    """Settings of `grpo_loss`.

    Attributes:
        clip_eps_low: the ratio is clipped below at 1 - clip_eps_low.
        clip_eps_high: the ratio is clipped above at 1 + clip_eps_high. Larger than clip_eps_low
            ("clip-higher", DAPO) so that unlikely tokens with positive advantage can still grow,
            which keeps entropy from collapsing.
        kl_coef: beta, the weight of the k3 KL to the reference policy (0: no KL term).
        is_correction: "none", "tis" (truncated IS) or "mis" (masked IS); see
            forge.losses.importance.
        tis_cap: C, the TIS weights are min(rho, C).
        mis_low, mis_high: MIS keeps a token iff mis_low <= rho <= mis_high.
        aggregation: how per-token losses become one number; see forge.losses.aggregation.
        norm_length: the constant L of "sequence_sum_norm" (None: the padded length).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    is_correction: ISCorrection = "none"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    aggregation: Aggregation = "token_mean"
    norm_length: int | None = None

    @property
    def corrects(self) -> bool:
        """Whether the generator's logprobs reweight (TIS) or mask (MIS) the loss's tokens."""
        return self.is_correction != "none"

    def __post_init__(self) -> None:
        if not 0 <= self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low must be in [0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.is_correction not in IS_CORRECTIONS:
            raise ValueError(
                f"is_correction must be one of {IS_CORRECTIONS}, got {self.is_correction!r}"
            )
        # rho = 1 (the engines agree) must pass each correction untouched.
        if self.tis_cap < 1:
            raise ValueError(f"tis_cap must be >= 1, got {self.tis_cap}")
        if not 0 <= self.mis_low <= 1 <= self.mis_high:
            raise ValueError(
                f"need 0 <= mis_low <= 1 <= mis_high, got mis_low={self.mis_low}, "
                f"mis_high={self.mis_high}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(f"norm_length must be >= 1, got {self.norm_length}")


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: GRPOConfig,
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
    cfg: GRPOConfig, logprobs: Tensor, behaviour_logprobs: Tensor | None
) -> Tensor | None:
    """Per-token weights of a KL estimated on tokens an older generator sampled: TIS's
    min(pi_theta / mu, tis_cap) under "tis", none under "none". MIS would drop tokens from
    the estimate: refused."""
    if cfg.is_correction == "mis":
        raise ValueError("objective 'distill' supports is_correction 'none' or 'tis', not 'mis'")
    if cfg.is_correction == "tis":
        return truncated_is_weights(logprobs, behaviour_logprobs, cfg.tis_cap)
    return None
