"""Compatibility of torchtitan 0.3.0 with CPU-only machines and gloo.

- torchtitan.distributed.parallel_dims takes its device type from torchtitan.tools.utils, which
  says "cuda" even where no GPU exists; building a device mesh then fails ("Unknown c10d backend
  type FAKE").
- Its FSDP setup uses a gradient divide factor of 1, which FSDP turns into ReduceOp.PREMUL_SUM;
  gloo refuses that op ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), so force plain SUM.
- `torchtitan.models.common.attention` calls `torch.compile(flex_attention)` in a class body, so
  importing any model imports Inductor and Dynamo's compiler set-up: most of the time a process
  takes to build a tiny model, though forge's models run SDPA and never call the compiled
  function. `compile_on_first_call` defers that compile to the function's first call.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial, wraps
from typing import Any

import torch


def use_device_type(device_type: str) -> None:
    """Makes torchtitan build its device meshes for `device_type` ("cpu" or "cuda")."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = device_type


def force_sum_reduction(model: torch.nn.Module) -> None:
    """Makes every FSDP module reduce gradients with SUM (gloo has no PREMUL_SUM)."""
    # Imported here: a driver imports this module (through forge.models.titan) and no FSDP.
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


@contextmanager
def compile_on_first_call() -> Iterator[None]:
    """Within the block, `torch.compile(fn, **options)` returns `fn` wrapped to be compiled, with
    those options, when it is first called (torchtitan 0.3.0 compiles at import)."""
    compile_now = torch.compile

    def deferred(fn: Callable | None = None, **options: Any) -> Callable:
        if fn is None:  # used as @torch.compile(**options)
            return partial(deferred, **options)
        compiled: Callable | None = None

        @wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            compiled = compiled or compile_now(fn, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = compile_now
