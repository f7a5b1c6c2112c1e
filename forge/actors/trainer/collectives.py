"""Numbers reduced over the trainer's ranks: metrics, token counts and pass counts that every
rank must agree on."""

from typing import Any

import torch
import torch.distributed as dist


def all_sum(value: float) -> float:
    """`value` summed over every rank."""
    return _all_reduce([value], dist.ReduceOp.SUM)[0]


def all_max(value: float) -> float:
    """The largest `value` of any rank."""
    return _all_reduce([value], dist.ReduceOp.MAX)[0]


def all_sum_each(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over every rank, in one collective (every rank has the same keys)."""
    keys = sorted(values)
    return dict(zip(keys, _all_reduce([values[k] for k in keys], dist.ReduceOp.SUM), strict=True))


def _all_reduce(values: list[float], op: Any) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()
