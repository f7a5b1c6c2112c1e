"""Per-token estimators of KL(pi || ref) from tokens sampled from pi (Schulman, "Approximating
KL Divergence", 2020).

With y ~ pi and the log ratio log r = log ref(y) - log pi(y):

- k1 = -log r = log pi - log ref: unbiased, high variance, negative for some tokens.
- k2 = (log r)^2 / 2: biased (exact to second order), low variance, >= 0.
- k3 = (r - 1) - log r: unbiased (E_pi[r] = 1) and low variance, >= 0 since log r <= r - 1.

Used as a loss term (GRPO's KL penalty), k3's gradient (1 - r) * grad log pi has expectation
grad KL(ref || pi) under y ~ pi, the forward KL rather than the reverse KL it estimates.
"""

import torch
from torch import Tensor


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi - log ref."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (log pi - log ref)^2 / 2."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(log ref - log pi) - (log ref - log pi) - 1."""
    log_r = ref_logprobs - logprobs
    # expm1 keeps precision where the policies are close: in float32, exp(x) - 1 carries an error
    # of ~1e-7, more than the true value ~x^2/2 once |x| < ~5e-4, the regime of a small KL.
    return torch.expm1(log_r) - log_r
