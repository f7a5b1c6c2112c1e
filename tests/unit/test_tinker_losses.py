"""The Tinker API's built-in losses (forge.losses.tinker) against forge's own objectives on the
same batch: equal losses and gradients where they are the same objective, up to Tinker's sum
in place of forge's mean."""

import pytest
import torch

from forge.losses import LossConfig, grpo_loss, sft_loss
from forge.losses.tinker import TINKER_LOSSES, loss_config, per_token_loss


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trainer logprobs (a leaf with grad), sampler logprobs, a mask with padding, advantages."""
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(3, 6, generator=g) * 3).requires_grad_()
    behaviour = logprobs.detach() + 0.3 * torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = mask[2, 2:] = False
    advantages = torch.randn(3, generator=g)
    return logprobs, behaviour, mask, advantages


def grad_of(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


def test_cross_entropy_is_forge_sft_summed():
    logprobs, _, mask, _ = batch()
    tinker = per_token_loss(
        "cross_entropy", logprobs, {"weights": mask.float()}, mask, loss_config("cross_entropy", {})
    ).sum()
    forge, _ = sft_loss(logprobs, mask, "token_mean")
    tokens = mask.sum()
    torch.testing.assert_close(tinker, forge * tokens)
    torch.testing.assert_close(grad_of(tinker, logprobs), grad_of(forge * tokens, logprobs))


def test_ppo_is_forge_grpo_clip_summed():
    logprobs, behaviour, mask, advantages = batch(1)
    per_token_advantages = advantages[:, None].expand_as(logprobs)
    inputs = {"logprobs": behaviour, "advantages": per_token_advantages}
    config = loss_config("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    tinker = per_token_loss("ppo", logprobs, inputs, mask, config).sum()
    forge_cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    forge, _ = grpo_loss(logprobs, behaviour, advantages, mask, forge_cfg)
    tokens = mask.sum()
    torch.testing.assert_close(tinker, forge * tokens)
    torch.testing.assert_close(grad_of(tinker, logprobs), grad_of(forge * tokens, logprobs))


def test_importance_sampling_on_policy_is_cross_entropy_weighted_by_advantage():
    """At ratio 1 (the sampler's logprobs are the trainer's) the IS gradient is the policy
    gradient: cross-entropy weighted by the advantages."""
    logprobs, _, mask, advantages = batch(2)
    per_token_advantages = advantages[:, None].expand_as(logprobs)
    inputs = {"logprobs": logprobs.detach(), "advantages": per_token_advantages}
    tinker = per_token_loss("importance_sampling", logprobs, inputs, mask, {}).sum()
    weighted = per_token_loss(
        "cross_entropy", logprobs, {"weights": per_token_advantages}, mask, {}
    ).sum()
    torch.testing.assert_close(grad_of(tinker, logprobs), grad_of(weighted, logprobs))


def test_cispo_weights_the_logprob_by_the_clipped_ratio_without_its_gradient():
    logprobs, behaviour, mask, advantages = batch(3)
    per_token_advantages = advantages[:, None].expand_as(logprobs)
    inputs = {"logprobs": behaviour, "advantages": per_token_advantages}
    loss = per_token_loss("cispo", logprobs, inputs, mask, loss_config("cispo", {})).sum()
    weight = torch.exp(logprobs.detach() - behaviour).clamp(0.8, 1.2)
    expected = torch.where(mask, -weight * per_token_advantages, 0.0)
    torch.testing.assert_close(grad_of(loss, logprobs), expected)


def test_dro_is_the_policy_gradient_at_the_sampler_and_pulls_back_toward_it_away():
    """At the sampler's logprobs the penalty and its gradient vanish: the gradient is
    -advantage per token. Away from them, the penalty's gradient is beta x the log-ratio."""
    logprobs, behaviour, mask, advantages = batch(5)
    per_token_advantages = advantages[:, None].expand_as(logprobs)
    config = loss_config("dro", {"beta": 0.5})
    on_policy = {"logprobs": logprobs.detach(), "advantages": per_token_advantages}
    loss = per_token_loss("dro", logprobs, on_policy, mask, config).sum()
    torch.testing.assert_close(
        grad_of(loss, logprobs), torch.where(mask, -per_token_advantages, 0.0)
    )
    off_policy = {"logprobs": behaviour, "advantages": per_token_advantages}
    loss = per_token_loss("dro", logprobs, off_policy, mask, config).sum()
    pull = 0.5 * (logprobs.detach() - behaviour)
    expected = torch.where(mask, -per_token_advantages + pull, 0.0)
    torch.testing.assert_close(grad_of(loss, logprobs), expected)


@pytest.mark.parametrize("name", TINKER_LOSSES)
def test_padding_gives_no_loss_and_no_gradient_even_when_it_holds_inf(name):
    logprobs, behaviour, mask, advantages = batch(4)
    with torch.no_grad():
        logprobs[~mask] = -float("inf")
    inputs = {
        "weights": mask.float(),
        "logprobs": behaviour,
        "advantages": advantages[:, None].expand_as(logprobs),
    }
    config = loss_config(name, {"beta": 0.1} if name == "dro" else {})
    loss = per_token_loss(name, logprobs, inputs, mask, config)
    assert torch.all(loss[~mask] == 0)
    grad = grad_of(loss.sum(), logprobs)
    assert torch.isfinite(grad).all() and torch.all(grad[~mask] == 0)


def test_unknown_loss_and_config_key_are_named():
    with pytest.raises(ValueError, match="unknown loss_fn 'dpo'"):
        loss_config("dpo", {})
    with pytest.raises(ValueError, match="takes no loss_fn_config key clip_eps"):
        loss_config("ppo", {"clip_eps": 0.1})
    with pytest.raises(ValueError, match="'dro' needs loss_fn_config key beta"):
        loss_config("dro", {})
