"""The Tinker API's built-in losses, as `forward_backward(data, loss_fn=NAME)` computes them.

Each datum brings its own per-token inputs (`loss_fn_inputs`): the target tokens, and per loss
`weights` (cross-entropy) or the sampler's `logprobs` and `advantages` (policy gradients). A
loss is a sum over tokens, with no normalisation: the caller's weights and advantages carry any
it wants (the Tinker service's definition, so a client's numbers mean the same here). Each
function takes the trainer's logprobs of the target tokens ([batch, seq], with grad) and the
inputs, and gives the loss per token; positions outside `mask` (padding) give 0.

The policy-gradient losses' importance ratio p_theta / q keeps its gradient, unlike the
trainer's own IS corrections (forge.losses.importance), whose weights are constants. DRO takes
no ratio: the policy gradient on the sampler's tokens minus beta/2 times the squared log-ratio.
"""

from collections.abc import Callable
from typing import Literal, get_args

import torch
from torch import Tensor

TinkerLoss = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
TINKER_LOSSES: tuple[str, ...] = get_args(TinkerLoss)

# The loss_fn_inputs each loss reads, besides "target_tokens".
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}

# The loss_fn_config keys each loss takes, with their defaults: the clipped ratio's bounds.
LOSS_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {},
}
# The keys a loss needs the caller to give: DRO's penalty weight has no published default.
REQUIRED_CONFIG: dict[str, tuple[str, ...]] = {"dro": ("beta",)}

PerToken = Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]


def _cross_entropy(logprobs: Tensor, x: dict[str, Tensor], _: dict[str, float]) -> Tensor:
    return -x["weights"] * logprobs


def _ratio(logprobs: Tensor, x: dict[str, Tensor]) -> Tensor:
    return torch.exp(logprobs - x["logprobs"])


def _importance_sampling(logprobs: Tensor, x: dict[str, Tensor], _: dict[str, float]) -> Tensor:
    return -_ratio(logprobs, x) * x["advantages"]


def _ppo(logprobs: Tensor, x: dict[str, Tensor], c: dict[str, float]) -> Tensor:
    ratio, advantages = _ratio(logprobs, x), x["advantages"]
    clipped = ratio.clamp(c["clip_low_threshold"], c["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)


def _cispo(logprobs: Tensor, x: dict[str, Tensor], c: dict[str, float]) -> Tensor:
    weight = _ratio(logprobs, x).clamp(c["clip_low_threshold"], c["clip_high_threshold"])
    return -weight.detach() * logprobs * x["advantages"]


def _dro(logprobs: Tensor, x: dict[str, Tensor], c: dict[str, float]) -> Tensor:
    # The policy gradient minus a quadratic penalty on the log-ratio to the sampler.
    penalty = 0.5 * c["beta"] * (logprobs - x["logprobs"]) ** 2
    return -(logprobs * x["advantages"] - penalty)


_PER_TOKEN: dict[str, PerToken] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
}


def loss_config(name: str, given: dict[str, float] | None) -> dict[str, float]:
    """`name`'s settings: its defaults, updated by `given`.

    Raises:
        ValueError: `name` is not a built-in loss, or `given` holds a key it does not take or
            lacks one it needs.
    """
    if name not in TINKER_LOSSES:
        raise ValueError(f"unknown loss_fn {name!r}: this server has {', '.join(TINKER_LOSSES)}")
    given = given or {}
    defaults, required = LOSS_CONFIG[name], REQUIRED_CONFIG.get(name, ())
    if unknown := sorted(set(given) - set(defaults) - set(required)):
        raise ValueError(f"loss_fn {name!r} takes no loss_fn_config key {', '.join(unknown)}")
    if missing := [key for key in required if key not in given]:
        raise ValueError(f"loss_fn {name!r} needs loss_fn_config key {', '.join(missing)}")
    return {**defaults, **given}


def per_token_loss(
    name: str, logprobs: Tensor, inputs: dict[str, Tensor], mask: Tensor, config: dict[str, float]
) -> Tensor:
    """Loss `name` per token ([batch, seq]): 0 outside `mask`, where the inputs are padding.

    Args:
        name: a TinkerLoss.
        logprobs: the trainer's logprobs of the target tokens, with grad.
        inputs: LOSS_INPUTS[name], each [batch, seq].
        mask: the real positions of each datum.
        config: loss_config(name, ...).
    """
    safe = torch.where(mask, logprobs, 0.0)  # padding's logprobs may be anything; keep it finite
    return torch.where(mask, _PER_TOKEN[name](safe, inputs, config), 0.0)
