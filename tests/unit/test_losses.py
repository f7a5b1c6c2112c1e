"""forge.losses against values worked out by hand on tiny tensors, and exact gradients."""

import math

import pytest
import torch
from torch.testing import assert_close

from forge.losses import (
    LossConfig,
    aggregate,
    group_advantages,
    grpo_loss,
    kl_k1,
    kl_k2,
    kl_k3,
    masked_mean,
    masked_sum,
    mismatch_kl,
    reverse_kl_loss,
    top_k_reverse_kl_loss,
)

NAN, INF = float("nan"), float("inf")


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def leaf(*rows) -> torch.Tensor:
    return t(*rows).requires_grad_()


def log(*rows) -> torch.Tensor:
    """Elementwise log of a literal, as the logprobs that give those ratios against 0."""
    return t(*rows).log()


# --- aggregation ---------------------------------------------------------------------------


def test_masked_reductions_ignore_padding_even_when_it_is_nan_or_inf():
    x = t([1.0, 2.0, NAN], [4.0, INF, 0.0], [NAN, NAN, NAN])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # 0/1 ints work like bools
    assert masked_sum(x, mask).item() == 7.0  # 1 + 2 + 4
    assert masked_mean(x, mask).item() == pytest.approx(7 / 3)
    # Per row: (1 + 2) / 2, 4 / 1, and an empty row gives 0 rather than 0 / 0.
    assert masked_mean(x, mask, dim=-1).tolist() == [1.5, 4.0, 0.0]


def test_token_mean_and_sequence_mean_differ_on_ragged_masks():
    x = t([1.0, 2.0, 3.0], [4.0, 9.0, 9.0])
    mask = t([1, 1, 1], [1, 0, 0])
    assert aggregate(x, mask, "token_mean").item() == pytest.approx(2.5)  # (1+2+3+4) / 4
    assert aggregate(x, mask, "sequence_mean").item() == pytest.approx(3.0)  # (2 + 4) / 2
    # 10 / (2 sequences * 3 padded length), then with a fixed budget L = 5: 10 / (2 * 5).
    assert aggregate(x, mask, "sequence_sum_norm").item() == pytest.approx(10 / 6)
    assert aggregate(x, mask, "sequence_sum_norm", norm_length=5).item() == pytest.approx(1.0)


def test_an_empty_sequence_does_not_dilute_sequence_mean_but_counts_in_sequence_sum_norm():
    x = t([1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0])
    mask = t([1, 1, 1], [1, 0, 0], [0, 0, 0])
    assert aggregate(x, mask, "sequence_mean").item() == pytest.approx(3.0)  # not (2+4+0)/3
    assert aggregate(x, mask, "sequence_sum_norm").item() == pytest.approx(10 / 9)  # B = 3


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(t([1.0]), t([1]), "mean")


# --- KL estimators -------------------------------------------------------------------------

LOGP = t([-1.0, -2.0, -1.0])
REF = t([-1.5, -2.0, -0.5])  # ref - logp = [-0.5, 0, +0.5]


def test_kl_estimators_by_hand():
    assert_close(kl_k1(LOGP, REF), t([0.5, 0.0, -0.5]))  # logp - ref: negative at the third
    assert_close(kl_k2(LOGP, REF), t([0.125, 0.0, 0.125]))  # 0.5 * 0.5^2
    # exp(-0.5) - (-0.5) - 1 = 0.60653066 - 0.5 = 0.10653066;  exp(0.5) - 0.5 - 1 = 0.14872127
    assert_close(kl_k3(LOGP, REF), t([0.10653066, 0.0, 0.14872127]))


def test_k3_is_non_negative_and_exactly_zero_for_equal_policies():
    torch.manual_seed(0)
    logp, ref = -torch.rand(4, 8) * 5, -torch.rand(4, 8) * 5
    assert (kl_k3(logp, ref) >= 0).all()
    assert (kl_k1(logp, ref) < 0).any()  # the estimator k3 improves on
    assert torch.equal(kl_k3(logp, logp), torch.zeros(4, 8))


def test_k3_keeps_precision_for_nearly_equal_policies():
    # True value (1e-4)^2 / 2 = 5e-9; exp(x) - 1 - x in float32 gives about 1.7e-8.
    assert_close(kl_k3(t([-1.0]), t([-1.0 + 1e-4])), t([5e-9]), rtol=2e-2, atol=0.0)


def test_k3_as_a_loss_follows_the_forward_kl_gradient():
    """Exactly, over a categorical: E_{y~pi}[grad k3(y)] = grad KL(ref || pi)."""
    theta = leaf(0.3, -1.2, 0.5, 2.0)
    ref = torch.log_softmax(t(1.0, 0.0, -1.0, 0.5), dim=-1)

    logp = torch.log_softmax(theta, dim=-1)
    (estimator,) = torch.autograd.grad((logp.exp().detach() * kl_k3(logp, ref)).sum(), theta)
    logp = torch.log_softmax(theta, dim=-1)
    (forward,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)
    logp = torch.log_softmax(theta, dim=-1)
    (reverse,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)

    assert_close(estimator, forward)
    assert not torch.allclose(estimator, reverse, atol=1e-3)


# --- GRPO ----------------------------------------------------------------------------------


def test_clipping_at_edges_for_positive_and_negative_advantages():
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28)  # bounds 0.8 and 1.28
    ratios = [0.5, 0.8, 1.0, 1.28, 1.5]
    logp = log(ratios, ratios).requires_grad_()
    old = torch.zeros(2, 5)
    assert torch.equal(logp.exp(), t(ratios, ratios))  # the edges are hit exactly

    loss, metrics = grpo_loss(logp, old, t(1.0, -1.0), torch.ones(2, 5), cfg)
    loss.backward()

    # A = +1: -min(r, clip(r)) = [-0.5, -0.8, -1, -1.28, -1.28], sum -4.86; 1.5 is clipped.
    # A = -1:  max(r, clip(r)) = [ 0.8,  0.8,  1,  1.28,  1.5 ], sum  5.38; 0.5 is clipped.
    assert loss.item() == pytest.approx((5.38 - 4.86) / 10)
    # dL/dlogp = -A * r / 10 where unclipped, 0 where clipped; at a bound the gradient flows.
    assert_close(logp.grad, t([-0.05, -0.08, -0.1, -0.128, 0.0], [0.0, 0.08, 0.1, 0.128, 0.15]))
    assert metrics["clip_frac"].item() == pytest.approx(0.2)  # 2 of 10 tokens
    assert metrics["ratio_mean"].item() == pytest.approx(2 * 5.08 / 10)
    assert metrics["loss"].item() == loss.item() and not metrics["loss"].requires_grad


def test_per_sequence_advantages_broadcast_over_tokens_even_when_batch_equals_seq():
    logp = leaf([-1.0, -1.0], [-1.0, -1.0])
    loss, _ = grpo_loss(logp, None, t(1.0, -1.0), torch.ones(2, 2), LossConfig())
    loss.backward()
    # r = 1, so the per-token gradient is -A / 4: row 0 has A = 1, row 1 has A = -1.
    assert_close(logp.grad, t([-0.25, -0.25], [0.25, 0.25]))


def test_old_logprobs_are_a_constant_even_when_passed_with_gradient():
    logp = leaf([-1.0, -2.0])
    loss, _ = grpo_loss(logp, logp * 1, t(1.0), torch.ones(1, 2), LossConfig())
    loss.backward()
    assert_close(logp.grad, t([-0.5, -0.5]))  # -A * r / 2, not 0


def test_grpo_aggregations_on_a_ragged_batch():
    mask = t([1, 1, 1], [1, 0, 0])
    advantages = t(1.0, -2.0)  # r = 1, so the per-token loss is -A: [-1,-1,-1], [2]
    results = {}
    for mode in ("token_mean", "sequence_mean", "sequence_sum_norm"):
        logp = leaf([-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0])
        loss, _ = grpo_loss(logp, None, advantages, mask, LossConfig(aggregation=mode))
        loss.backward()
        results[mode] = loss.item(), logp.grad
    assert results["token_mean"][0] == pytest.approx(-0.25)  # (-3 + 2) / 4
    assert results["sequence_mean"][0] == pytest.approx(0.5)  # (-1 + 2) / 2
    assert results["sequence_sum_norm"][0] == pytest.approx(-1 / 6)  # (-3 + 2) / (2 * 3)
    assert_close(results["token_mean"][1], t([-0.25, -0.25, -0.25], [0.5, 0.0, 0.0]))
    # Per sequence: each of the 3 tokens of row 0 weighs 1/3 of 1/2, row 1's one token 1/2.
    assert_close(results["sequence_mean"][1], t([-1 / 6, -1 / 6, -1 / 6], [1.0, 0.0, 0.0]))


def test_padding_values_reach_neither_loss_nor_gradient():
    cfg = LossConfig(is_correction="tis", kl_coef=0.1)
    mask = t([1, 1, 0], [1, 0, 0])

    def run(pad: float):
        def fill(values):
            return torch.where(mask.bool(), t(*values), pad)

        logp = fill([[-1.0, -0.5, 0.0], [-2.0, 0.0, 0.0]]).requires_grad_()
        loss, metrics = grpo_loss(
            logp,
            fill([[-1.2, -0.4, 0.0], [-1.8, 0.0, 0.0]]),
            fill([[1.0, -1.0, 0.0], [0.5, 0.0, 0.0]]),  # per-token advantages
            mask,
            cfg,
            behaviour_logprobs=fill([[-1.0, -0.6, 0.0], [-2.5, 0.0, 0.0]]),
            ref_logprobs=fill([[-0.9, -0.7, 0.0], [-2.2, 0.0, 0.0]]),
        )
        loss.backward()
        return loss, logp.grad, metrics

    clean_loss, clean_grad, clean_metrics = run(0.0)
    for pad in (NAN, INF, -INF):
        loss, grad, metrics = run(pad)
        assert_close(loss, clean_loss)
        assert_close(grad, clean_grad)
        assert grad[~mask.bool()].eq(0).all()
        assert all(torch.isfinite(value) for value in metrics.values())
        assert_close(metrics, clean_metrics)


def test_tis_truncates_the_weight_at_the_cap():
    # Decoupled: the trainer's proximal logprobs are 0; the generator's give rho = [0.5,1,2,4].
    old = torch.zeros(1, 4)
    behaviour = -log([0.5, 1.0, 2.0, 4.0])
    logp = leaf([0.0, 0.0, 0.0, 0.0])  # r = 1: only the IS weight shapes the loss
    cfg = LossConfig(is_correction="tis", tis_cap=2.0)
    loss, metrics = grpo_loss(logp, old, t(1.0), torch.ones(1, 4), cfg, behaviour)
    loss.backward()
    # w = min(rho, 2) = [0.5, 1, 2, 2]; loss = -sum(w) / 4 = -5.5 / 4
    assert loss.item() == pytest.approx(-1.375)
    assert_close(logp.grad, t([-0.125, -0.25, -0.5, -0.5]))
    assert metrics["is_weight_mean"].item() == pytest.approx(1.375)
    # k3 of the mismatch per token is rho - 1 - log rho, > 0 except at rho = 1.
    assert metrics["mismatch_kl"].item() == pytest.approx(
        sum(x - math.log(x) - 1 for x in (0.5, 1.0, 2.0, 4.0)) / 4
    )


def test_tis_on_fresh_data_uses_the_detached_current_logprobs_as_proximal():
    logp = log([0.5, 1.0, 2.0, 4.0]).requires_grad_()  # trainer; the generator said log 1 = 0
    cfg = LossConfig(is_correction="tis", tis_cap=2.0)
    loss, metrics = grpo_loss(logp, None, t(-1.0), torch.ones(1, 4), cfg, torch.zeros(1, 4))
    loss.backward()
    # r = 1 in value; gradient per token = -A * w / 4 = w / 4, w = [0.5, 1, 2, 2]
    assert_close(logp.grad, t([0.125, 0.25, 0.5, 0.5]))
    assert metrics["clip_frac"].item() == 0.0


def test_mis_drops_tokens_outside_the_bounds_and_keeps_the_bounds():
    old = torch.zeros(1, 5)
    behaviour = -log([0.25, 0.5, 1.0, 2.0, 4.0])  # rho = [0.25, 0.5, 1, 2, 4]
    logp = leaf([0.0, 0.0, 0.0, 0.0, 0.0])
    cfg = LossConfig(is_correction="mis", mis_low=0.5, mis_high=2.0)
    loss, metrics = grpo_loss(logp, old, t(1.0), torch.ones(1, 5), cfg, behaviour)
    loss.backward()
    # Kept: rho = 0.5, 1, 2 (bounds included), weighted by rho, averaged over the 3 kept tokens.
    assert loss.item() == pytest.approx(-3.5 / 3)
    assert_close(logp.grad, t([0.0, -0.5 / 3, -1 / 3, -2 / 3, 0.0]))
    assert metrics["mis_masked_frac"].item() == pytest.approx(0.4)
    assert metrics["is_weight_mean"].item() == pytest.approx(3.5 / 3)


def test_kl_penalty_adds_beta_times_k3():
    logp = leaf([-1.0, -2.0, -1.0])
    cfg = LossConfig(kl_coef=0.1)
    loss, metrics = grpo_loss(logp, None, t(0.0), torch.ones(1, 3), cfg, ref_logprobs=REF)
    loss.backward()
    # A = 0 leaves only the KL: 0.1 * (0.10653066 + 0 + 0.14872127) / 3
    assert metrics["kl"].item() == pytest.approx(0.08508398)
    assert loss.item() == pytest.approx(0.008508398)
    # d k3 / d logp = 1 - exp(ref - logp) = [1 - e^-0.5, 0, 1 - e^0.5]
    #               = [0.39346934, 0, -0.64872127]
    assert_close(logp.grad, 0.1 / 3 * t([0.39346934, 0.0, -0.64872127]))


def test_missing_inputs_raise():
    logp, ones = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        grpo_loss(logp, None, t(1.0), ones, LossConfig(is_correction="mis"))
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, None, t(1.0), ones, LossConfig(kl_coef=0.01))


@pytest.mark.parametrize(
    "field, value",
    [
        ("clip_eps_low", 1.0),
        ("clip_eps_high", -0.1),
        ("kl_coef", -1.0),
        ("is_correction", "ppo"),
        ("tis_cap", 0.5),
        ("mis_low", 1.5),
        ("mis_high", 0.9),
        ("aggregation", "mean"),
        ("norm_length", 0),
    ],
)
def test_grpo_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value})


# --- advantages ----------------------------------------------------------------------------


def test_group_advantages_use_the_sample_std():
    # mean 1, sample std sqrt((1 + 0 + 1) / 2) = 1; population std would give -1.2247.
    assert_close(group_advantages(t(0.0, 1.0, 2.0)), t(-1.0, 0.0, 1.0) / (1 + 1e-6))


def test_group_advantages_per_group_and_equal_rewards_give_zeros():
    rewards = torch.tensor([[1, 0, 0, 1], [2, 2, 2, 2]])  # ints are accepted
    # Group 0: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735027; 0.5 / (0.57735027 + 1e-6)
    a = 0.8660239
    assert_close(group_advantages(rewards), t([a, -a, -a, a], [0.0, 0.0, 0.0, 0.0]))
    assert_close(
        group_advantages(rewards, normalize_std=False), t([0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0])
    )
    equal = group_advantages(torch.full((2, 5), 0.1))
    assert torch.isfinite(equal).all() and equal.abs().max() < 1e-5


def test_group_advantages_reject_groups_of_one():
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(t([1.0], [2.0]))


# --- distillation --------------------------------------------------------------------------


def test_reverse_kl_loss_per_token_gradient_and_metric():
    logp = leaf([-1.0, -2.0, NAN])
    teacher = t([-1.5, -1.0, NAN])
    mask = t([1, 1, 0])
    loss, metrics = reverse_kl_loss(logp, teacher, mask)
    loss.backward()
    # A = -(logp - teacher) = [-0.5, 1]; dL/dlogp = -A / 2 = [0.25, -0.5]: descent lowers the
    # token the student over-rates and raises the one the teacher prefers.
    assert_close(logp.grad, t([0.25, -0.5, 0.0]))
    assert metrics["reverse_kl"].item() == pytest.approx(-0.25)  # (0.5 - 1) / 2


def test_reverse_kl_loss_gradient_is_exact_in_expectation():
    """Over every token of a categorical, weighted by the student: grad E_s[loss] = grad KL."""
    theta = leaf(0.3, -1.2, 0.5, 2.0)
    teacher = torch.log_softmax(t(1.0, 0.0, -1.0, 0.5), dim=-1)
    student = torch.log_softmax(theta, dim=-1)
    probs = student.exp().detach()

    expected_loss, expected_kl = 0.0, 0.0
    for y in range(4):
        loss, metrics = reverse_kl_loss(student[y].view(1, 1), teacher[y].view(1, 1), t([1]))
        expected_loss = expected_loss + probs[y] * loss
        expected_kl = expected_kl + probs[y] * metrics["reverse_kl"]
    (estimated,) = torch.autograd.grad(expected_loss, theta)

    student = torch.log_softmax(theta, dim=-1)
    kl = (student.exp() * (student - teacher)).sum()
    (true,) = torch.autograd.grad(kl, theta)
    assert_close(estimated, true)
    assert_close(expected_kl, kl.detach())


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k (by `logits`) token ids and the log-softmax at them, per position."""
    values, ids = logits.topk(k, dim=-1)
    return ids, values - torch.logsumexp(logits, dim=-1, keepdim=True)


def test_top_k_reverse_kl_of_a_student_equal_to_its_teacher_is_zero_with_zero_gradient():
    theta = leaf(*torch.randn(2, 3, 50).tolist())
    ids, teacher = top_k(theta.detach(), 8)
    student = torch.log_softmax(theta, -1).gather(-1, ids)
    loss, metrics = top_k_reverse_kl_loss(student, teacher, t([1, 1, 1], [1, 1, 0]))
    loss.backward()
    assert abs(metrics["reverse_kl"].item()) < 1e-6
    assert theta.grad.abs().max().item() < 1e-6


def test_top_k_reverse_kl_is_the_full_kl_over_the_whole_vocabulary_and_a_lower_bound_below():
    student_logits, teacher_logits = torch.randn(4, 50), 2 * torch.randn(4, 50)
    s, q = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    full = (s.exp() * (s - q)).sum(-1)
    mask = torch.ones(1, 4, dtype=torch.bool)
    previous = 0.0
    for k in (1, 5, 20, 50):
        ids, teacher = top_k(teacher_logits, k)
        _, metrics = top_k_reverse_kl_loss(s.gather(-1, ids)[None], teacher[None], mask)
        kl = metrics["reverse_kl"].item()
        assert previous - 1e-5 <= kl <= full.mean().item() + 1e-5  # more buckets, more KL
        previous = kl
    assert kl == pytest.approx(full.mean().item(), abs=1e-5)
    assert metrics["teacher_top_k_mass"].item() == pytest.approx(1.0, abs=1e-5)


def test_top_k_reverse_kl_gradient_moves_mass_to_the_teachers_token():
    """A token the student rarely samples still gets its gradient: descent raises the
    teacher's favourite even when the student gives it 1% (the sampled estimator would
    rarely see it)."""
    theta = leaf(5.0, 0.4, 0.0, 0.0)
    teacher_logits = t(0.0, 6.0, 0.0, 0.0)
    ids, teacher = top_k(teacher_logits, 2)
    student = torch.log_softmax(theta, -1).gather(-1, ids)
    loss, _ = top_k_reverse_kl_loss(student.view(1, 1, 2), teacher.view(1, 1, 2), t([1]))
    loss.backward()
    assert theta.grad[1] < 0 < theta.grad[0]  # descent: token 1 up, token 0 down
    assert torch.log_softmax(theta, -1)[1].exp() < 0.01


# --- mismatch ------------------------------------------------------------------------------


def test_mismatch_kl_is_zero_for_identical_logprobs():
    logp = -torch.rand(3, 4)
    kl, abs_diff = mismatch_kl(logp, logp.clone(), torch.ones(3, 4))
    assert kl.item() == 0.0 and abs_diff.item() == 0.0


def test_mismatch_kl_by_hand():
    trainer = t([-1.0, -2.0, 9.0])
    generator = t([-1.5, -1.5, NAN])
    # trainer - generator = [0.5, -0.5]: k3 = [e^0.5 - 1.5, e^-0.5 - 0.5] = [0.14872127, 0.10653066]
    kl, abs_diff = mismatch_kl(trainer, generator, t([1, 1, 0]))
    assert kl.item() == pytest.approx(0.12762597)
    assert abs_diff.item() == pytest.approx(0.5)
