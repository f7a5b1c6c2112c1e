"""Group-relative advantages (GRPO, Shao et al. 2024): each completion's reward against the
others sampled for the same prompt, so no value network is needed."""

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean_g(r)) / (std_g(r) + eps) within each group g.

    std is the sample standard deviation (divides by G - 1), as in TRL's and verl's GRPO.
    normalize_std=False gives A_i = r_i - mean_g(r) (Dr. GRPO: dividing by std up-weights the
    groups that are almost all right or all wrong). A group whose rewards are all equal carries no
    signal and gets 0, not NaN.

    Args:
        rewards: [G] one group, or [num_groups, G].
        normalize_std: divide by the group's std.
        eps: keeps the division finite for a group of equal rewards.

    Returns:
        Advantages shaped like `rewards`, floating point.
    """
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards must be [G] or [num_groups, G], got {tuple(rewards.shape)}")
    if rewards.shape[-1] < 2:
        raise ValueError(f"a group needs at least 2 rewards to compare, got {rewards.shape[-1]}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if not normalize_std:
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True) + eps)
