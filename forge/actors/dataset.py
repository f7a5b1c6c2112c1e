"""DatasetActor: serves prompt rows in a fixed, resumable order to the rollout loop."""

from typing import Any

from monarch.actor import endpoint

from forge.controller import ForgeActor
from forge.data.datasets import (
    LocalDataset,
    LocalDatasetConfig,
    PromptDataset,
    ReasoningGymConfig,
    ReasoningGymDataset,
)


class DatasetActor(ForgeActor):
    """A reasoning-gym task or a local Hugging Face dataset, one row per `next` call."""

    def __init__(self, cfg: ReasoningGymConfig | LocalDatasetConfig) -> None:
        super().__init__()
        self.cfg = cfg

    @endpoint
    async def setup(self) -> None:
        if isinstance(self.cfg, LocalDatasetConfig):
            self.dataset: PromptDataset = LocalDataset(self.cfg)
        else:
            self.dataset = ReasoningGymDataset(self.cfg)

    @endpoint
    async def next(self) -> dict[str, Any]:
        """The next row (the order repeats, reshuffled, every epoch)."""
        return next(self.dataset)

    @endpoint
    async def nth(self, n: int) -> dict[str, Any]:
        """Row n of the iteration: the same row for the same n, whatever the call order."""
        return self.dataset.nth(n)

    @endpoint
    async def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    @endpoint
    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
