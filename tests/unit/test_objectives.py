"""The trainer's objectives, looked up by name in forge.losses.OBJECTIVES."""

from dataclasses import dataclass, field
from typing import get_args

import pytest
import torch
from torch.testing import assert_close

from forge.actors.trainer import TrainerConfig
from forge.config import ConfigError, load_config
from forge.losses import (
    OBJECTIVES,
    LossConfig,
    ObjectiveInputs,
    ObjectiveName,
    grpo_loss,
    sft_loss,
)

NAN = float("nan")


@dataclass
class Holder:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def inputs(logprobs, mask, behaviour=None, teacher=None, advantages=None) -> ObjectiveInputs:
    logprobs = torch.tensor(logprobs).requires_grad_()
    mask = torch.tensor(mask, dtype=torch.bool)
    behaviour = logprobs.detach().clone() if behaviour is None else torch.tensor(behaviour)
    advantages = torch.zeros(mask.shape[0]) if advantages is None else torch.tensor(advantages)
    teacher = None if teacher is None else torch.tensor(teacher)
    return ObjectiveInputs(logprobs, mask, behaviour, advantages, teacher_logprobs=teacher)


def test_every_objective_is_registered_by_the_names_the_config_accepts(tmp_path):
    assert set(OBJECTIVES) == set(get_args(ObjectiveName)) == {"grpo", "distill", "sft"}
    # An app sets the objective; a run folder's saved config holds the one it ran with.
    saved = tmp_path / "config.yaml"
    saved.write_text("trainer: {objective: dpo}\n")
    with pytest.raises(ConfigError, match="trainer.objective: Invalid value 'dpo'"):
        load_config(Holder, saved, known_only=True)
    with pytest.raises(ValueError, match="objective must be one of"):
        TrainerConfig(objective="dpo")
    assert TrainerConfig(objective="distill").objective == "distill"


def test_sft_is_the_mean_negative_log_likelihood_of_answer_tokens_only():
    x = inputs([[-1.0, -2.0, NAN], [-3.0, NAN, NAN]], [[1, 1, 0], [1, 0, 0]])
    loss, metrics = OBJECTIVES["sft"](x, LossConfig())
    assert loss.item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    loss.backward()
    assert_close(x.logprobs.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [-1 / 3, 0.0, 0.0]]))
    assert metrics["loss"].item() == pytest.approx(2.0)
    assert sft_loss(x.logprobs, x.mask, "sequence_mean")[0].item() == pytest.approx(2.25)


def test_distill_with_student_equal_to_teacher_has_zero_kl_and_zero_gradient():
    logprobs = [[-0.3, -2.5, -1.1], [-0.7, -0.2, NAN]]
    x = inputs(logprobs, [[1, 1, 1], [1, 1, 0]], teacher=[[-0.3, -2.5, -1.1], [-0.7, -0.2, 0.0]])
    loss, metrics = OBJECTIVES["distill"](x, LossConfig(is_correction="tis"))
    loss.backward()
    assert metrics["reverse_kl"].item() == 0.0
    assert x.logprobs.grad.abs().max().item() == 0.0


def test_distill_reweights_samples_of_an_older_generator_by_truncated_is():
    # Student now gives the token log p = -1; the generator sampled it at log mu = -2 (rho =
    # e, capped at 2) and at -1 (rho = 1). Teacher at -1.5: advantage -(p - q) = -0.5 on both.
    x = inputs([[-1.0], [-1.0]], [[1], [1]], behaviour=[[-2.0], [-1.0]], teacher=[[-1.5], [-1.5]])
    loss, metrics = OBJECTIVES["distill"](x, LossConfig(is_correction="tis", tis_cap=2.0))
    loss.backward()
    # per token: -w * A * logp, token mean over 2: grad = -w * A / 2 = w * 0.25.
    assert_close(x.logprobs.grad, torch.tensor([[0.5], [0.25]]))
    assert metrics["is_weight_mean"].item() == pytest.approx(1.5)
    plain = inputs([[-1.0], [-1.0]], [[1], [1]], behaviour=[[-2.0], [-1.0]], teacher=[[-1.5]] * 2)
    OBJECTIVES["distill"](plain, LossConfig())[0].backward()
    assert_close(plain.logprobs.grad, torch.tensor([[0.25], [0.25]]))


def test_distill_refuses_missing_teacher_logprobs_and_mis():
    x = inputs([[-1.0]], [[1]])
    with pytest.raises(ValueError, match="needs teacher_logprobs"):
        OBJECTIVES["distill"](x, LossConfig())
    x = inputs([[-1.0]], [[1]], teacher=[[-1.0]])
    with pytest.raises(ValueError, match="not 'mis'"):
        OBJECTIVES["distill"](x, LossConfig(is_correction="mis"))


def test_distill_over_the_teachers_top_k_reports_both_kls_and_refuses_is_correction():
    x = inputs([[-1.0, -0.5]], [[1, 0]], teacher=[[-1.5, 0.0]])
    x.student_top_logprobs = torch.tensor([[[-1.0, -2.0], [NAN, NAN]]], requires_grad=True)
    x.teacher_top_logprobs = torch.tensor([[[-0.4, -1.5], [NAN, NAN]]])
    loss, metrics = OBJECTIVES["distill"](x, LossConfig())
    loss.backward()
    s, q = torch.tensor([-1.0, -2.0]), torch.tensor([-0.4, -1.5])
    rest_s, rest_q = 1 - s.exp().sum(), 1 - q.exp().sum()
    expected = (s.exp() * (s - q)).sum() + rest_s * (rest_s.log() - rest_q.log())
    assert metrics["reverse_kl"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["sampled_reverse_kl"].item() == pytest.approx(0.5)  # -1 - (-1.5)
    assert torch.isfinite(x.student_top_logprobs.grad).all()  # padding holds NaN
    assert x.student_top_logprobs.grad[0, 1].abs().sum() == 0
    assert x.logprobs.grad is None  # the sampled token's logprob carries no loss here
    with pytest.raises(ValueError, match="is_correction to 'none'"):
        OBJECTIVES["distill"](x, LossConfig(is_correction="tis"))


def test_grpo_objective_clips_against_the_generator_without_is_correction():
    x = inputs([[-1.0, -1.0]], [[1, 1]], behaviour=[[-1.5, -0.5]], advantages=[1.0])
    loss, metrics = OBJECTIVES["grpo"](x, LossConfig())
    expected, _ = grpo_loss(x.logprobs, x.behaviour_logprobs, x.advantages, x.mask, LossConfig())
    assert loss.item() == pytest.approx(expected.item())
    assert "mismatch_kl" not in metrics  # the trainer measures it under the right weights
