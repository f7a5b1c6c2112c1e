"""Reward functions for end-to-end tests: importable by the reward workers by name."""

from collections.abc import Mapping
from typing import Any


def vowel_fraction(row: Mapping[str, Any], text: str) -> float:
    """The share of vowels among the letters: varies across random-model samples, so every
    group has non-zero advantages and the trainer really moves."""
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / max(len(letters), 1)


def brevity(row: Mapping[str, Any], text: str) -> float:
    """1 for an answer of at most 8 words, else 0. SmolLM2 often rambles after answering; a
    policy learns quickly to stop (one token, end-of-sequence, made more likely)."""
    return float(len(text.split()) <= 8)
