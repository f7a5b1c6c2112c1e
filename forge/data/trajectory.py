"""Trajectory: a multi-turn episode's tokens, built turn by turn, never re-tokenized.

Each turn is sampled from the trajectory's tokens so far (`context`), and its tokens are kept
as the generator returned them; an environment's answer is appended as the token ids the chat
template renders it to (forge.data.chat). `completion()` gives the whole episode after its
first prompt as one Completion whose mask is 1 on sampled tokens: what the trainer reads, as it
reads a single-turn completion (the one-turn case: a mask of ones).
"""

from dataclasses import dataclass, field

from forge.data.completion import Completion


@dataclass
class Trajectory:
    """The tokens of one episode.

    Args:
        prompt_ids: the first prompt's token ids.
        token_ids: every token after it: sampled turns and observations, in order.
        mask: 1 on sampled tokens, 0 on observation tokens.
        logprobs: the behaviour logprob of each sampled token (0.0 on observation tokens).
        token_versions: the policy version of each sampled token (an observation token has its
            turn's version before it, so the oldest and newest versions are the sampled ones').
        texts: each sampled turn's text.
        stop_reason: the last turn's.
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    stop_reason: str = ""

    @property
    def context(self) -> list[int]:
        """The ids the next turn is sampled from."""
        return self.prompt_ids + self.token_ids

    @property
    def turns(self) -> int:
        return len(self.texts)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.mask)

    def add_turn(self, completion: Completion) -> None:
        """Appends a sampled turn; it must have been sampled from `context`."""
        if completion.prompt_ids != self.context:
            raise ValueError(
                f"turn {self.turns + 1} was sampled from {len(completion.prompt_ids)} prompt "
                f"tokens that are not this trajectory's {len(self.context)}"
            )
        self.token_ids += completion.token_ids
        self.mask += completion.sampled()
        self.logprobs += completion.logprobs
        self.token_versions += completion.token_versions
        self.texts.append(completion.text)
        self.stop_reason = completion.stop_reason

    def add_observation(self, ids: list[int]) -> None:
        """Appends tokens the policy did not sample (an environment's answer, the template's
        markup around it, the next generation prompt)."""
        if not self.texts:
            raise ValueError("an observation follows a sampled turn: the first prompt is given")
        version = self.token_versions[-1] if self.token_versions else 0
        self.token_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.token_versions += [version] * len(ids)

    def completion(self) -> Completion:
        """The episode after its first prompt, as one masked Completion."""
        return Completion(
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.token_ids),
            text="".join(self.texts),
            logprobs=list(self.logprobs),
            token_versions=list(self.token_versions),
            stop_reason=self.stop_reason,
            metadata={"turns": self.turns},
            mask=None if all(self.mask) else list(self.mask),  # a single turn: all sampled
        )
