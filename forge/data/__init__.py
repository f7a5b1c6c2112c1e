"""Data: completions and episodes, datasets, rewards, collation. Plain Python, no Monarch."""

from forge.data.completion import Completion
from forge.data.episode import Episode

__all__ = ["Completion", "Episode"]
