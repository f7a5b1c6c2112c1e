"""GRPO whose group BLOWN_GROUP gets advantages of +-3e38: a scoring bug that blows up the batch
holding it (test_replay's divergence-guard runs). An app file, as a user would write one:

    forge run tests/helper_blow_up.py --config configs/grpo/tiny_cpu.yaml ...
"""

import importlib.util
import sys
from pathlib import Path

import cloudpickle

from forge.data import Episode
from forge.envs.runner import EpisodeOutcome

BLOWN_GROUP = 4


def _import_grpo():
    """apps/grpo/main.py, under a name of its own (this file is the app `forge run` imports)."""
    path = Path(__file__).parents[1] / "apps" / "grpo" / "main.py"
    spec = importlib.util.spec_from_file_location("forge_grpo_app", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # actor processes cannot import it by name
    return module


grpo = _import_grpo()
Config = grpo.Config


class BlowUp(grpo.GRPO):
    async def score(self, group: int, row: dict, outcomes: list[EpisodeOutcome]) -> list[Episode]:
        episodes = await super().score(group, row, outcomes)
        if group == BLOWN_GROUP:
            for i, episode in enumerate(episodes):
                episode.advantage = 3e38 if i % 2 else -3e38
        return episodes


async def main(cfg: Config) -> None:
    await BlowUp.main(cfg)
