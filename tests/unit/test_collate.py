import torch

from forge.data import Completion, Episode
from forge.data.collate import collate, first_position, gather_tokens


def episode(prompt, tokens, logprobs, advantage, ref=None) -> Episode:
    c = Completion(prompt, tokens, "", logprobs, [1] * len(tokens), "length")
    return Episode("e", "g", c, advantage=advantage, ref_logprobs=ref)


def test_positions_line_up_with_next_token_logprobs():
    batch = collate(
        [
            episode([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], 1.0, ref=[-1.0, -2.0, -3.0]),
            episode([5], [4], [-0.5], -1.0, ref=[-4.0]),
        ],
        pad_id=0,
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    # position j predicts token j+1: completion tokens 7, 8, 9 sit at positions 1, 2, 3
    assert batch.mask.tolist() == [[False, True, True, True], [True, False, False, False]]
    assert torch.equal(batch.behaviour_logprobs[0], torch.tensor([0.0, -0.1, -0.2, -0.3]))
    assert batch.ref_logprobs[1].tolist() == [-4.0, 0.0, 0.0, 0.0]
    assert batch.advantages.tolist() == [1.0, -1.0] and batch.num_tokens == 4
    assert gather_tokens(batch.behaviour_logprobs, batch.mask) == [
        [torch.tensor(-0.1).item(), torch.tensor(-0.2).item(), torch.tensor(-0.3).item()],
        [-0.5],
    ]
    assert batch.teacher_logprobs is None


def test_teacher_top_k_lines_up_as_k_values_per_completion_position():
    episodes = [episode([5, 6], [7, 8], [-0.1, -0.2], 0.0), episode([5], [4], [-0.5], 0.0)]
    episodes[0].teacher_top_ids, episodes[0].teacher_top_logprobs = [[7, 3], [8, 1]], [[-1, -2]] * 2
    episodes[1].teacher_top_ids, episodes[1].teacher_top_logprobs = [[9, 4]], [[-0.5, -1.5]]
    batch = collate(episodes)
    assert batch.teacher_top_ids.dtype == torch.long and batch.teacher_top_ids.shape == (2, 3, 2)
    assert batch.teacher_top_ids.tolist() == [[[0, 0], [7, 3], [8, 1]], [[9, 4], [0, 0], [0, 0]]]
    assert batch.teacher_top_logprobs[1, 0].tolist() == [-0.5, -1.5]
    assert batch.teacher_top_logprobs[0, 0].tolist() == [0.0, 0.0]


def test_first_position_is_the_earliest_completion_position_of_any_row():
    short = Episode("a", "g", Completion([1, 2], [3, 4], "", [-1.0, -1.0], [0, 0], ""))
    long = Episode("b", "g", Completion([1, 2, 5, 6], [3], "", [-1.0], [0], ""))
    assert first_position(collate([long]).mask) == 3
    assert first_position(collate([long, short]).mask) == 1
    assert first_position(torch.zeros((2, 5), dtype=torch.bool)) == 0
