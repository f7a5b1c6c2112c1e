"""Publishing the trainer's weights as versions the generators load: gathered on rank 0, HF-named
(with LoRA, the adapters PEFT-named, or the weights with them folded in), in the generators'
dtype, written through the configured transport."""

import time
from collections.abc import Callable

import torch

from forge.actors.trainer.model import Model
from forge.controller.compute_thread import ComputeThread
from forge.models.hf_layout import HfLayout
from forge.models.lora import merge
from forge.weights.sync_config import WeightSyncConfig
from forge.weights.transport import make_transport


class Publisher:
    """Publishes versions of `model`'s weights.

    Args:
        cfg: what a version holds (`lora.publish`, `dtype`) and where it goes (`transport`).
        model: the trained model.
    """

    def __init__(self, cfg: WeightSyncConfig, model: Model) -> None:
        self.cfg = cfg
        self.model = model
        self.transport = make_transport(cfg.transport)
        self._hf_layout: Callable[[dict], dict] | None = None  # learned at the first use

    async def push(self, version: int, compute: ComputeThread) -> dict[str, float]:
        """Publishes the current weights as `version`, gathered on `compute` (the thread the
        model's tensors are used on). Call on every rank; rank 0 publishes. Returns the
        seconds gathering and publishing took, and the bytes published."""
        start = time.perf_counter()
        state_dict = await compute.run(self.state_dict)
        gathered = time.perf_counter()
        if state_dict is None:
            return {"gather_s": gathered - start}
        manifest = await self.transport.publish(version, state_dict)
        return {
            "gather_s": gathered - start,
            "publish_s": time.perf_counter() - gathered,
            "bytes": manifest.total_bytes,
        }

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """What a version holds, on rank 0 (None on the other ranks): the full weights
        HF-named, or with LoRA the adapters PEFT-named (or with `lora.publish: merged`, the
        weights with the adapters folded in), in the configured `dtype`. Reordered tensors
        live in buffers that the next call overwrites. A collective."""
        lora, model = self.cfg.lora, self.model
        if lora is not None and lora.publish == "adapter":
            adapters = model.full_state_dict(adapters_only=True)
            if model.rank != 0:
                return None
            return _in_dtype(model.peft_layout(adapters), self.cfg.dtype)
        state_dict = model.full_state_dict()
        if model.rank != 0:
            return None
        if lora is not None:
            state_dict = merge(state_dict, lora)
        if self._hf_layout is None:
            self._hf_layout = HfLayout.learn(model.titan.adapter, state_dict) or (
                model.titan.adapter.to_hf
            )
        return _in_dtype(self._hf_layout(state_dict), self.cfg.dtype)


def _in_dtype(state_dict: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """`state_dict` with its floating-point tensors in `dtype`."""
    target = getattr(torch, dtype)
    return {k: v.to(target) if v.is_floating_point() else v for k, v in state_dict.items()}
