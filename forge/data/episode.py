"""Episode: a scored completion on its way from the rollout loop to the trainer."""

from dataclasses import dataclass, field

from forge.data.completion import Completion


@dataclass
class Episode:
    """One completion with its reward and advantage.

    Args:
        episode_id: unique id, so the replay buffer and metrics can tell a reuse from a copy.
        group_id: the prompt's id; GRPO normalises rewards within a group.
        completion: what the generator produced.
        reward: the total reward.
        rewards: each reward function's score, by name.
        advantage: set once the whole group is scored.
        ref_logprobs: reference-model logprobs of the completion tokens (for the KL term).
        teacher_logprobs: teacher logprobs of the completion tokens (for distillation).
        teacher_top_ids: at each completion position, the teacher's k most likely tokens, or
            None (distillation then estimates the KL from the sampled tokens alone).
        teacher_top_logprobs: their teacher logprobs, the same shape.
        row: the source index of the data row its prompt came from (None: not from a row).
    """

    episode_id: str
    group_id: str
    completion: Completion
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None
    teacher_logprobs: list[float] | None = None
    teacher_top_ids: list[list[int]] | None = None
    teacher_top_logprobs: list[list[float]] | None = None
    row: int | None = None

    @property
    def policy_version(self) -> int | None:
        """The oldest policy version that sampled any of its tokens."""
        return self.completion.policy_version
