"""DatasetActor: serves prompt rows in a fixed, resumable order to the rollout loop."""

from typing import Any

from monarch.actor import endpoint

from forge.controller import ForgeActor, retry_safe
from forge.data.datasets import DataConfig, PromptDataset, open_dataset


class DatasetActor(ForgeActor):
    """The training rows of a `data:` section, by their place in the iteration (`nth`).

    Args:
        cfg: the data section.
        hold_out: rows kept apart for eval (forge.data.datasets.PromptDataset): the driver
            holds out the same rows from the same config, so they are never served here.
    """

    def __init__(self, cfg: DataConfig, hold_out: int | float = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.hold_out = hold_out

    @endpoint
    async def setup(self) -> None:
        self.dataset: PromptDataset = open_dataset(self.cfg, self.hold_out)

    @endpoint
    @retry_safe
    async def nth(self, n: int) -> dict[str, Any]:
        """Row n of the iteration: the same row for the same n, whatever the call order (so a
        call is retried on a respawned actor)."""
        return self.dataset.nth(n)
