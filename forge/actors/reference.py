"""ReferenceModel: a frozen model that scores completions, for the KL term or as a teacher."""

import asyncio
from dataclasses import dataclass

import torch
from monarch.actor import endpoint

from forge.controller import ForgeActor, retry_safe
from forge.data.collate import gather_tokens, pad_sequences
from forge.models import resolve_model
from forge.models.titan import load_pretrained, token_logprobs


@dataclass
class ReferenceConfig:
    """The frozen model, and the temperature its logprobs are taken at (the generator's)."""

    model: str = "SmolLM2-135M-Instruct"
    temperature: float = 1.0
    max_batch: int = 16  # sequences per forward pass: bounds memory


class ReferenceModel(ForgeActor):
    """Per-token logprobs of completion tokens under fixed weights (never the full logits)."""

    def __init__(self, cfg: ReferenceConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or ReferenceConfig()

    @endpoint
    async def setup(self) -> None:
        self.model = await asyncio.to_thread(load_pretrained, resolve_model(self.cfg.model))
        self.model.requires_grad_(False)

    @endpoint
    @retry_safe
    async def logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """For each (prompt ids, completion ids): the logprob of every completion token."""
        return await asyncio.to_thread(self._logprobs, pairs)

    def _logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        out: list[list[float]] = []
        for start in range(0, len(pairs), self.cfg.max_batch):
            input_ids, mask = pad_sequences(pairs[start : start + self.cfg.max_batch])
            with torch.no_grad():
                logprobs = token_logprobs(self.model, input_ids, self.cfg.temperature)
            out.extend(gather_tokens(logprobs, mask))
        return out
