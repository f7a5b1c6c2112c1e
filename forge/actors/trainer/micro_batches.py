"""A rank's episodes in micro-batches: similar lengths together, and as many on every rank."""

import math

from forge.actors.trainer.collectives import all_max
from forge.data.episode import Episode


def micro_batches(episodes: list[Episode], size: int) -> list[tuple[list[Episode], bool]]:
    """This rank's episodes in chunks of `size` (0: all at once), each with whether it is real.

    Sorted by length first. Every rank runs as many chunks as the rank with the most, so
    FSDP's collectives pair up; a rank with fewer fills in with one of its episodes at
    weight 0 (real=False).
    """
    size = size or max(len(episodes), 1)
    count = int(all_max(math.ceil(len(episodes) / size)))
    # Similar lengths together: each micro-batch pads to its longest sequence.
    episodes = by_length(episodes)
    chunks = [episodes[i * size : (i + 1) * size] for i in range(count)]
    return [(chunk or episodes[:1], bool(chunk)) for chunk in chunks]


def by_length(episodes: list[Episode]) -> list[Episode]:
    """`episodes` from the shortest sequence (prompt and completion) to the longest."""
    return sorted(episodes, key=_length)


def _length(episode: Episode) -> int:
    return len(episode.completion.prompt_ids) + len(episode.completion.token_ids)
