"""A hand-built 3-turn episode: its trajectory's mask, logprobs and versions, and what the
trainer's batch and loss make of it (observation tokens are not trained on)."""

import pytest
import torch

from forge.data import Completion, Episode
from forge.data.collate import collate
from forge.data.trajectory import Trajectory
from forge.losses.config import LossConfig
from forge.losses.grpo import grpo_loss

PROMPT = [1, 2, 3]


def turn(context: list[int], ids: list[int], version: int, text: str) -> Completion:
    logprobs = [-0.5 - i / 10 for i in range(len(ids))]
    return Completion(list(context), ids, text, logprobs, [version] * len(ids), "stop")


def three_turns() -> Trajectory:
    """Turn 1 (version 4), a tool result, turn 2 (version 4), feedback, turn 3 (version 5: an
    in-flight update landed between turns 2 and 3)."""
    t = Trajectory(PROMPT)
    t.add_turn(turn(t.context, [10, 11], 4, "a"))
    t.add_observation([20, 21, 22])
    t.add_turn(turn(t.context, [12], 4, "b"))
    t.add_observation([23])
    t.add_turn(turn(t.context, [13, 14, 15], 5, "c"))
    return t


def test_the_mask_logprobs_and_versions_of_a_three_turn_episode():
    t = three_turns()
    assert t.token_ids == [10, 11, 20, 21, 22, 12, 23, 13, 14, 15]
    assert t.mask == [1, 1, 0, 0, 0, 1, 0, 1, 1, 1]
    assert t.logprobs == [-0.5, -0.6, 0.0, 0.0, 0.0, -0.5, 0.0, -0.5, -0.6, -0.7]
    assert t.token_versions == [4, 4, 4, 4, 4, 4, 4, 5, 5, 5]
    assert (t.turns, t.sampled_tokens) == (3, 6)
    c = t.completion()
    assert (c.prompt_ids, c.text, c.mask, c.policy_version) == (PROMPT, "abc", t.mask, 4)


def test_a_turn_not_sampled_from_the_trajectory_is_refused():
    t = Trajectory(PROMPT)
    t.add_turn(turn(PROMPT, [10], 0, "a"))
    t.add_observation([20])
    with pytest.raises(ValueError, match="turn 2 was sampled from 4 prompt tokens"):
        t.add_turn(turn(PROMPT + [10], [12], 0, "b"))  # the observation is missing
    with pytest.raises(ValueError, match="an observation follows a sampled turn"):
        Trajectory(PROMPT).add_observation([20])


def test_a_mask_of_another_length_is_refused():
    with pytest.raises(ValueError, match="3 tokens, 3 logprobs, 3 versions, 2 mask values"):
        Completion([1], [5, 6, 7], "abc", [-0.1] * 3, [0] * 3, "stop", mask=[1, 0])


def test_the_batch_trains_on_the_sampled_tokens_only():
    single = Episode("s", "g", turn(PROMPT, [7, 8], 4, "x"), advantage=-1.0)
    multi = Episode("m", "g", three_turns().completion(), advantage=1.0)
    batch = collate([single, multi])
    # Position j holds token j + 1: the completion starts at position len(PROMPT) - 1 = 2.
    assert batch.mask[0].tolist() == [False, False, True, True] + [False] * 8
    assert batch.mask[1].tolist() == [False, False] + [bool(m) for m in three_turns().mask]
    assert batch.num_tokens == 2 + 6
    assert batch.behaviour_logprobs[1, 2:].tolist() == pytest.approx(three_turns().logprobs)
    assert batch.policy_versions == [4, 4]


def test_observation_tokens_move_neither_the_loss_nor_its_gradient():
    batch = collate([Episode("m", "g", three_turns().completion(), advantage=1.0)])
    observed = ~batch.mask & (batch.behaviour_logprobs == 0)
    observed[:, :2] = False  # the prompt

    def loss_and_grad(noise: float):
        logprobs = batch.behaviour_logprobs.clone() + noise * observed
        logprobs.requires_grad_(True)
        old = batch.behaviour_logprobs - 0.1  # ratios away from 1, so the loss is not 0
        loss, _ = grpo_loss(logprobs, old, batch.advantages, batch.mask, LossConfig())
        loss.backward()
        return loss.item(), logprobs.grad

    (loss, grad), (noisy_loss, noisy_grad) = loss_and_grad(0.0), loss_and_grad(3.0)
    assert observed.sum() == 4
    assert noisy_loss == loss != 0
    assert torch.equal(noisy_grad, grad) and not grad[observed].any()
