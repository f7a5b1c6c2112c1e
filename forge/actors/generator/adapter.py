"""The LoRA adapter a generator's engine serves, when the trainer trains LoRA.

vLLM loads an adapter from a PEFT folder. Each version is written as one (a few MB) in this
generator's own shared-memory folder, then loaded in place under one `LoRARequest` id, which
every request carries. Before the first version the engine serves a zero adapter: the base
model, under the same id, so no request ever runs without it.
"""

import uuid
from pathlib import Path
from typing import Any

import torch

from forge.models.hf_export import save_peft
from forge.models.lora import LoRAConfig, peft_config
from forge.weights.shm_folders import ShmFolder

ADAPTER_NAME = "forge"
ADAPTER_ID = 1
# The version folders kept: the loaded one, and the one before it (requests admitted before
# the swap still name it; vLLM reads a folder only when it loads an adapter).
_KEPT = 2


class AdapterSlot:
    """One engine's adapter.

    Args:
        cfg: the adapter's rank, alpha and targets (the trainer's).
        base: the base checkpoint folder the adapter applies to.
        shapes: the adapter's tensors (PEFT names) and shapes, from forge.models.lora.peft_shapes.
    """

    def __init__(self, cfg: LoRAConfig, base: Path, shapes: dict[str, tuple[int, ...]]) -> None:
        self.cfg = cfg
        self.base = base
        self.shapes = shapes
        self.request: Any = None  # the LoRARequest requests carry; None until `start`
        self._folder = ShmFolder.create(f"lora-{uuid.uuid4().hex[:16]}", "generator")
        self._written: list[Path] = []

    async def start(self, engine: Any) -> None:
        """Loads the zero adapter (version 0: the base model's outputs)."""
        zeros = {name: torch.zeros(shape) for name, shape in self.shapes.items()}
        await self.load(engine, self.write(0, zeros))

    def write(self, version: int, tensors: dict[str, torch.Tensor]) -> Path:
        """Writes `version`'s tensors (verified by the caller) as a PEFT folder; its path."""
        path = save_peft(
            tensors, peft_config(self.cfg, str(self.base)), self._folder.path / f"v{version}"
        )
        # A version may come again (a calibration's sync back, a restarted trainer's): one
        # folder, now the newest.
        if path in self._written:
            self._written.remove(path)
        self._written.append(path)
        return path

    async def load(self, engine: Any, path: Path) -> None:
        """Has `engine` load the adapter at `path` in place of the one it serves; every request
        from now on (and those running) uses it. Older folders are removed."""
        from vllm.lora.request import LoRARequest

        await engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(path), load_inplace=True))
        self.request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(path))
        while len(self._written) > _KEPT:
            _remove(self._written.pop(0))

    def close(self) -> None:
        """Removes every folder written."""
        self._folder.remove()


def _remove(path: Path) -> None:
    for file in path.iterdir():
        file.unlink()
    path.rmdir()
