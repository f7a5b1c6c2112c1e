"""Importance-sampling corrections for the mismatch between the generator and the trainer.

Three policies take part in an asynchronous GRPO step (decoupled PPO, Hilton et al. 2022):

- behaviour mu: the generator that sampled the tokens (vLLM: its own kernels and precision, and
  possibly older weights); its logprobs come with each Completion.
- proximal pi_prox: the *trainer's* log-probabilities under the same parameters that generated,
  recomputed by the trainer. On fresh data (one optimizer step per batch) these are simply the
  current logprobs, detached.
- current pi_theta: the parameters being trained.

Even with identical weights mu != pi_prox numerically, so the samples are slightly off-policy for
the trainer ("Your efficient RL framework secretly brings you off-policy RL training", Yao et al.
2025). The per-token correction is the ratio of the two same-parameter policies,

    rho_t = pi_prox(y_t) / mu(y_t) = exp(proximal_logprobs_t - behaviour_logprobs_t),

a constant weight in the loss (no gradient flows through it). Two ways to bound its variance:

- TIS (truncated IS, Yao et al. 2025): w_t = min(rho_t, C).
- MIS (masked IS, Liu, Li et al. 2025, "When Speed Kills Stability"): w_t = rho_t if
  lo <= rho_t <= hi, else the token is dropped from the loss entirely (as if it were padding):
  a token the two engines disagree on that much carries no usable signal.
"""

import torch
from torch import Tensor

from forge.losses.aggregation import masked_mean
from forge.losses.kl import kl_k3


def importance_ratio(proximal_logprobs: Tensor, behaviour_logprobs: Tensor) -> Tensor:
    """rho = exp(log pi_prox - log mu), detached: a weight, never a path for the gradient."""
    return torch.exp(proximal_logprobs - behaviour_logprobs).detach()


def truncated_is_weights(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float
) -> Tensor:
    """TIS weights min(rho, cap)."""
    return importance_ratio(proximal_logprobs, behaviour_logprobs).clamp(max=cap)


def masked_is_weights(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """MIS: (weights rho, keep) where keep = low <= rho <= high, bounds included.

    The caller removes the tokens outside `keep` from its loss mask; the weights of kept tokens
    are rho itself, not clipped.
    """
    rho = importance_ratio(proximal_logprobs, behaviour_logprobs)
    return rho, (rho >= low) & (rho <= high)


def mismatch_kl(
    trainer_logprobs: Tensor, generator_logprobs: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Health gauge of the generator/trainer mismatch on the same tokens, same weights.

    Returns (KL(mu || pi) estimate, mean |log pi - log mu|) over the valid tokens, detached. The
    tokens were sampled from the generator mu, so k3 with mu as the sampling distribution,

        KL(mu || pi) ~= mean_t [exp(log pi_t - log mu_t) - (log pi_t - log mu_t) - 1],

    is unbiased and >= 0 per token. It is ~1e-5..1e-3 for a healthy dense model; a rise means the
    engines disagree (precision, kernels, a failed weight sync) and IS weights grow with it.
    """
    trainer_logprobs = trainer_logprobs.detach()
    generator_logprobs = generator_logprobs.detach()
    kl = masked_mean(kl_k3(generator_logprobs, trainer_logprobs), mask)
    abs_diff = masked_mean((trainer_logprobs - generator_logprobs).abs(), mask)
    return kl, abs_diff
