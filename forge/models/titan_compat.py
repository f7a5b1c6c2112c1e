"""Compatibility of torchtitan 0.3.0 with CPU-only machines and gloo.

- torchtitan.distributed.parallel_dims takes its device type from torchtitan.tools.utils, which
  says "cuda" even where no GPU exists; building a device mesh then fails ("Unknown c10d backend
  type FAKE").
- Its FSDP setup uses a gradient divide factor of 1, which FSDP turns into ReduceOp.PREMUL_SUM;
  gloo refuses that op ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), so force plain SUM.
"""

import torch
from torch.distributed.fsdp import FSDPModule


def use_device_type(device_type: str) -> None:
    """Makes torchtitan build its device meshes for `device_type` ("cpu" or "cuda")."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = device_type


def force_sum_reduction(model: torch.nn.Module) -> None:
    """Makes every FSDP module reduce gradients with SUM (gloo has no PREMUL_SUM)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
