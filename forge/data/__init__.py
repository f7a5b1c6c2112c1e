"""Data: completions and episodes, datasets, rewards, collation. Plain Python, no Monarch."""

from forge.data.completion import Completion

__all__ = ["Completion"]
