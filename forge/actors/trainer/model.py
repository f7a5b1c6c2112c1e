"""The trainer's model as one rank holds it, and what the trainer's parts do with its tensors:
move inputs to its device, list the parameters the optimizer changes, run a block on other
values of them, and gather the full weights on rank 0."""

import contextlib
import hashlib
import struct
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from forge.models.lora import PeftLayout, is_adapter
from forge.models.titan import TitanModel


@dataclass
class Model:
    """The trainer's model on this rank.

    Args:
        titan: the torchtitan config and HF state-dict adapter it was built from (with LoRA,
            LoRA's).
        module: the built module: sharded with FSDP over the ranks, or whole on one rank.
        device: the CUDA device it is on; None on CPUs.
        rank: this process's rank.
        world: the number of ranks.
        precision: the context its forward passes run in: bfloat16 autocast on CPUs when the
            config's dtype is bfloat16, else a no-op (on GPUs FSDP casts).
        peft_layout: with LoRA, where each adapter goes in PEFT's layout, on rank 0 (learned
            when the model is built); None otherwise.
    """

    titan: TitanModel
    module: torch.nn.Module
    device: torch.device | None
    rank: int
    world: int
    precision: Callable[[], contextlib.AbstractContextManager]
    peft_layout: PeftLayout | None = None

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the model's device."""
        return tensor if self.device is None else tensor.to(self.device)

    def trained_parameters(self) -> list[torch.Tensor]:
        """The parameters the optimizer changes (with LoRA, the adapters), in their sharded
        form: FSDP may leave a module unsharded after a forward pass, and a copy must see the
        same tensors every time."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return [p for p in self.module.parameters() if p.requires_grad]

    def digest(self) -> str:
        """A digest of the trained parameters' values, the same on every rank: a CRC-32 of each
        shard a rank holds (on as many threads as torch computes with), hashed in rank order.
        Equal digests on as many ranks mean bit-identical parameters, but for a chance of
        2^-32 per tensor that differs. A collective when there are several ranks."""
        import torch.distributed as dist

        shards = [_local(p).contiguous().cpu() for p in self.trained_parameters()]
        with ThreadPoolExecutor(torch.get_num_threads()) as pool:  # crc32 lets go of the GIL
            crcs = list(pool.map(_crc32, shards))
        mine = hashlib.sha256(struct.pack(f"<{len(crcs)}I", *crcs)).hexdigest()
        if self.world == 1:
            return mine[:32]
        every: list[str] = [""] * self.world
        dist.all_gather_object(every, mine)
        return hashlib.sha256("".join(every).encode()).hexdigest()[:32]

    @contextlib.contextmanager
    def swapped(self, snapshot: list[torch.Tensor]) -> Iterator[None]:
        """Runs the block on `snapshot`'s values of the trained parameters, then puts the
        current ones back (`snapshot` holds them meanwhile).

        A plain module's parameters are pointed at the snapshot's storage; FSDP's values are
        swapped in place, one tensor of scratch at a time: a second copy of the whole model
        would raise the step's peak.
        """
        self._swap(snapshot)
        try:
            yield
        finally:
            self._swap(snapshot)

    def _swap(self, snapshot: list[torch.Tensor]) -> None:
        from torch.distributed.fsdp import FSDPModule

        params = self.trained_parameters()
        if not isinstance(self.module, FSDPModule):
            # A plain module's parameters can point at other storage: nothing is copied.
            for i, param in enumerate(params):
                param.data, snapshot[i] = snapshot[i], param.data
            return
        # FSDP keeps its own views of the sharded storage: the values move instead.
        for param, other in zip(params, snapshot, strict=True):
            param = param.detach()
            scratch = param.clone()
            param.copy_(other)
            other.copy_(scratch)

    def full_state_dict(self, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's full tensors (or its LoRA adapters alone) on rank 0. On one unsharded
        rank they alias the live parameters, which is fine: publishing and exporting copy them
        before the next step."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        if self.world == 1 and not isinstance(self.module, FSDPModule):
            # Nothing to gather: get_model_state_dict would only add its own overhead.
            state_dict = self.module.state_dict()
            if adapters_only:
                return {k: v for k, v in state_dict.items() if is_adapter(k)}
            return state_dict
        # A collective: rank 0 receives full tensors.
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapters_only
        )
        return get_model_state_dict(self.module, options=options)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `param` (a DTensor under FSDP), or `param` itself."""
    param = param.detach()
    return param.to_local() if hasattr(param, "to_local") else param


def _crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.view(torch.uint8).numpy().data)
