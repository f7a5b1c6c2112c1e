"""Completion: one sampled continuation of a prompt, as the generator produced it."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Completion:
    """A generated sequence with what the trainer needs to correct for staleness.

    Args:
        prompt_ids: the prompt's token ids.
        token_ids: the generated token ids.
        text: the generated text.
        logprobs: one per generated token: log p(token) under the policy that sampled it (the
            behaviour policy), after temperature, as the trainer computes it.
        token_versions: the policy version that sampled each token. They differ within one
            sequence after an in-flight or abort-and-resume weight update.
        stop_reason: "stop" (end of sequence or a stop string), "length" (max tokens) or
            "abort".
        metadata: free-form (request id, generator replica, ...).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    token_versions: list[int]
    stop_reason: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.token_versions):
            raise ValueError(
                f"completion has {len(self.token_ids)} tokens, {len(self.logprobs)} logprobs "
                f"and {len(self.token_versions)} versions: they must match"
            )

    @property
    def policy_version(self) -> int | None:
        """The oldest version that sampled any token (None for an empty completion)."""
        return min(self.token_versions, default=None)
