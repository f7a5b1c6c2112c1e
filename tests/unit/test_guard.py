"""The divergence guard's verdicts (forge.actors.trainer.guard): non-finite figures always, a
gradient norm far above the running median once the window is full, nothing when off."""

import pytest

from forge.actors.trainer.config import GuardConfig
from forge.actors.trainer.guard import Guard


def test_a_step_that_blows_up_is_refused_and_only_applied_steps_make_the_median():
    guard = Guard(GuardConfig(grad_norm_ratio=10.0, window=3))
    assert guard.verdict(float("nan"), 1.0) == "loss nan"
    assert guard.verdict(0.5, float("inf")) == "grad norm inf"
    assert guard.verdict(0.5, 1e6) is None  # no history yet: only non-finite figures count
    for norm in (1.0, 2.0, 3.0, 2.0):
        guard.applied(norm)
    assert guard.norms == [2.0, 3.0, 2.0]  # the last `window`
    assert guard.verdict(0.5, 20.0) is None  # 10 x the median 2.0, not above it
    assert guard.verdict(0.5, 20.5) == ("grad norm 20.5 > 10 x 2, the median of the last 3 steps")
    restored = Guard(GuardConfig(window=3))
    restored.load_state_dict(guard.state_dict())  # a checkpoint carries the history
    assert restored.norms == guard.norms


def test_off_applies_everything_and_bad_settings_are_refused():
    assert Guard(GuardConfig(action="off")).verdict(float("nan"), float("nan")) is None
    with pytest.raises(ValueError, match="grad_norm_ratio > 1"):
        GuardConfig(grad_norm_ratio=0.5)
