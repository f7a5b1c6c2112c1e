"""Collation: episodes -> padded tensors for one forward pass of prompt + completion.

Position j of every per-token tensor describes token j+1 of `input_ids`, the token whose
logprob the model's output at position j gives. Per-token values are placed at the completion's
positions; `mask` marks those of them the policy sampled (all of a single-turn completion; a
multi-turn episode's observation tokens are not trained on).
"""

from dataclasses import dataclass

import torch

from forge.data.episode import Episode


@dataclass
class Batch:
    """Padded training tensors for a list of episodes.

    Shapes: input_ids [B, T]; mask, behaviour_logprobs, ref_logprobs, teacher_logprobs
    [B, T-1]; teacher_top_ids, teacher_top_logprobs [B, T-1, k]; advantages [B].
    """

    input_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    behaviour_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    teacher_logprobs: torch.Tensor | None
    teacher_top_ids: torch.Tensor | None
    teacher_top_logprobs: torch.Tensor | None
    policy_versions: list[int | None]

    @property
    def num_tokens(self) -> int:
        """Sampled tokens in the batch (what a token-mean loss divides by)."""
        return int(self.mask.sum())


def sequences(episodes: list[Episode]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) of each episode."""
    return [(e.completion.prompt_ids, e.completion.token_ids) for e in episodes]


def pad_sequences(
    pairs: list[tuple[list[int], list[int]]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] (prompt + completion, right-padded) and the completion mask [B, T-1]."""
    length = max(len(p) + len(c) for p, c in pairs)
    input_ids = torch.full((len(pairs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), length - 1), dtype=torch.bool)
    for i, (prompt, completion) in enumerate(pairs):
        input_ids[i, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        mask[i, len(prompt) - 1 : len(prompt) - 1 + len(completion)] = True
    return input_ids, mask


def first_position(mask: torch.Tensor) -> int:
    """The first position any row's mask covers (0 if none does): the positions before it
    need no logits."""
    covered = mask.any(dim=0).nonzero()
    return int(covered[0]) if len(covered) else 0


def scatter_tokens(
    values: list[list], mask: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Places each sequence's per-completion-token values at its mask positions (0 elsewhere).

    A value may itself be a list of k (e.g. top-k ids): the result is then [B, T-1, k].
    """
    rows = [torch.tensor(row, dtype=dtype) for row in values]
    trailing = next((tuple(r.shape[1:]) for r in rows if r.numel()), ())
    out = torch.zeros((*mask.shape, *trailing), dtype=dtype)
    for i, row in enumerate(rows):
        out[i, mask[i]] = row.reshape(-1, *trailing)
    return out


def gather_tokens(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """The inverse of `scatter_tokens`: each sequence's values at its completion positions."""
    return [values[i, mask[i]].tolist() for i in range(mask.shape[0])]


def collate(episodes: list[Episode], pad_id: int = 0) -> Batch:
    """Pads a list of episodes into a Batch."""
    input_ids, completion = pad_sequences(sequences(episodes), pad_id)

    def optional(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        rows = [getattr(e, name) for e in episodes]
        return None if any(r is None for r in rows) else scatter_tokens(rows, completion, dtype)

    sampled = [e.completion.sampled() for e in episodes]
    return Batch(
        input_ids=input_ids,
        mask=scatter_tokens(sampled, completion, torch.bool),
        advantages=torch.tensor([e.advantage for e in episodes], dtype=torch.float32),
        behaviour_logprobs=scatter_tokens([e.completion.logprobs for e in episodes], completion),
        ref_logprobs=optional("ref_logprobs"),
        teacher_logprobs=optional("teacher_logprobs"),
        teacher_top_ids=optional("teacher_top_ids", torch.long),
        teacher_top_logprobs=optional("teacher_top_logprobs"),
        policy_versions=[e.policy_version for e in episodes],
    )
