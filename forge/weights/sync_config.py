"""The weight-sync section: what a published version holds and how it travels, set once for the
trainer that publishes and the generators that load.

    weight_sync:
      transport: {kind: shm}      # or rdma / torchstore, across hosts
      dtype: bfloat16             # the engines' dtype, so every version's
      lora: {rank: 16, publish: merged}

A run gives this one config to every role that needs it (`RunConfig.roles()`), so the trainer
and the generators cannot disagree on any of it.
"""

from dataclasses import dataclass, field
from typing import Literal

from forge.models.lora import LoRAConfig
from forge.weights.transport import TransportConfig

WeightDtype = Literal["float32", "bfloat16", "float16"]


@dataclass
class WeightSyncConfig:
    """How weights go from the trainer to the generators.

    Args:
        transport: which transport carries the versions, and where.
        dtype: the generators' engine dtype (their weights and compute), which is also the
            dtype every published version holds: a bfloat16 engine gets half the bytes,
            already rounded as its loader would round them. The trainer's own parameters stay
            float32 whatever it is (trainer.dtype is the trainer's compute).
        lora: train LoRA adapters on the frozen model instead of the model itself
            (forge.models.lora): only adapters hold gradients and optimizer state, and
            checkpoints hold them alone. `lora.publish` says what a version holds: "adapter"
            (the adapters in PEFT's layout, which the engines serve as a LoRA adapter) or
            "merged" (the weights with the adapters folded in, served as a plain model).
            None: full fine-tuning.
    """

    transport: TransportConfig = field(default_factory=TransportConfig)
    dtype: WeightDtype = "float32"
    lora: LoRAConfig | None = None

    def served_adapter(self) -> LoRAConfig | None:
        """The LoRA adapter the engines serve: `lora` when versions are adapters, None (a
        plain model) when they are merged weights or there is no LoRA."""
        lora = self.lora
        return lora if lora is not None and lora.publish == "adapter" else None
