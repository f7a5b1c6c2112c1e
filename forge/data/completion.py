"""Completion: one sampled continuation of a prompt, as the generator produced it, or a whole
multi-turn episode after its first prompt (forge.data.trajectory builds one), whose `mask`
tells the sampled tokens from the environment's."""

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
        mask: 1 on each token the policy sampled, 0 on tokens it was given (a multi-turn
            episode's observations: their logprob is 0.0 and their version that of the turn
            before); None when every token was sampled. The loss, the mismatch KL and the
            staleness bound read only the sampled tokens.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    token_versions: list[int]
    stop_reason: str
    metadata: dict[str, Any] = field(default_factory=dict)
    mask: list[int] | None = None

    def __post_init__(self) -> None:
        lengths = [len(self.token_ids), len(self.logprobs), len(self.token_versions)]
        if self.mask is not None:
            lengths.append(len(self.mask))
        if len(set(lengths)) > 1:
            names = ("tokens", "logprobs", "versions", "mask values")
            counts = ", ".join(f"{n} {name}" for n, name in zip(lengths, names, strict=False))
            raise ValueError(f"completion has {counts}: they must match")

    def sampled(self) -> list[int]:
        """1 for each token the policy sampled, 0 for each it was given."""
        return [1] * len(self.token_ids) if self.mask is None else self.mask

    def sampled_versions(self) -> list[int]:
        """The version that sampled each sampled token, in order."""
        return [v for v, s in zip(self.token_versions, self.sampled(), strict=True) if s]

    @property
    def policy_version(self) -> int | None:
        """The oldest version that sampled any token (None when none was sampled)."""
        return min(self.sampled_versions(), default=None)
