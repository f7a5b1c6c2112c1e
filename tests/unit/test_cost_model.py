"""The cost model (forge/placement/cost_model.py) on made-up phase costs: each placement's
seconds per step and policy age, and the choice: a split only where it wins by more than the
spread of the measurements."""

import pytest

from forge.loop.config import overlaps
from forge.placement.cost_model import MIN_SPREAD, PhaseCosts, decide, predict, table

# Training dominates, as on the 2-core machine: a core more helps training more than it
# helps generation.
TRAINING_BOUND = PhaseCosts(
    generate_s={1: 10.0, 2: 6.0},
    train_s={1: 60.0, 2: 34.0},
    stale_s={1: 3.0, 2: 2.0},
    sync_s=1.0,
)
GENERATION_BOUND = PhaseCosts(
    generate_s={1: 40.0, 2: 24.0},
    train_s={1: 20.0, 2: 12.0},
    stale_s={1: 1.0, 2: 0.5},
    sync_s=1.0,
)


def by_label(predictions):
    return {p.label: p for p in predictions}


def test_sync_alternates_the_phases_on_either_placement():
    p = by_label(predict(TRAINING_BOUND, 2, overlaps("sync", 1), 1, exact_mismatch=True))
    assert p["colocated"].seconds_per_step == 6.0 + 34.0 + 1.0
    assert p["split 1+1"].seconds_per_step == 10.0 + 60.0 + 1.0
    assert p["colocated"].policy_age == p["split 1+1"].policy_age == 0.0
    assert decide(list(p.values()), 0.0).chosen.label == "colocated"


def test_async_split_runs_at_the_slower_side_and_pays_the_stale_pass():
    p = by_label(predict(GENERATION_BOUND, 2, overlaps("async", 1), 1, exact_mismatch=True))
    assert p["split 1+1"].seconds_per_step == max(40.0, 20.0 + 1.0 + 1.0)
    assert p["split 1+1"].policy_age == 1.0  # generation-bound: each batch one step behind
    trained = by_label(predict(TRAINING_BOUND, 2, overlaps("async", 2), 2, exact_mismatch=True))
    assert trained["split 1+1"].seconds_per_step == 60.0 + 1.0 + 3.0
    assert trained["split 1+1"].policy_age == 2.0  # training-bound: the buffer runs ahead


def test_colocated_costs_the_same_in_both_modes_and_is_never_stale():
    sync, asynchronous = (
        by_label(predict(TRAINING_BOUND, 2, overlaps(mode, 1), 1, exact_mismatch=True))["colocated"]
        for mode in ("sync", "async")
    )
    assert sync.seconds_per_step == asynchronous.seconds_per_step == 6.0 + 34.0 + 1.0
    assert asynchronous.policy_age == 0.0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_age_zero_async_is_sync(mode):
    p = by_label(predict(GENERATION_BOUND, 2, overlaps(mode, 0), 0, exact_mismatch=True))
    assert p["split 1+1"].seconds_per_step == 40.0 + 20.0 + 1.0


def test_the_fastest_split_wins_by_more_than_the_spread_and_the_table_marks_it():
    costs = PhaseCosts({1: 40.0, 3: 30.0, 4: 28.0}, {1: 50.0, 3: 20.0, 4: 16.0},
                       {1: 0.0, 3: 0.0, 4: 0.0}, 0.5)  # fmt: skip
    predictions = predict(costs, 4, overlaps("async", 1), 1, exact_mismatch=False)
    # Only the splits whose two sides were measured: 1+3 and 3+1.
    assert [p.label for p in predictions] == ["colocated", "split 1+3", "split 3+1"]
    decision = decide(predictions, 0.0)
    best = decision.chosen
    assert best.label == "split 1+3" and best.seconds_per_step == 40.0
    assert decision.runner_up.label == "colocated" and decision.margin_s == 44.5 - 40.0
    assert decision.line() == "split 1+3: margin 4.5 s/step over colocated, spread 2.2 s/step (5%)"
    lines = table(predictions, best).splitlines()
    assert [line.lstrip().startswith("*") for line in lines] == [False, True, False]


def test_a_tie_goes_to_colocated():
    costs = PhaseCosts({1: 10.0, 2: 5.0}, {1: 10.0, 2: 5.0}, {1: 0.0, 2: 0.0}, 0.0)
    predictions = predict(costs, 2, overlaps("async", 1), 1, exact_mismatch=False)
    assert [p.seconds_per_step for p in predictions] == [10.0, 10.0]
    assert decide(predictions, 0.0).chosen.label == "colocated"


# On two cores, async: colocated G(2) + T(2) + S = 30.7 s/step, split 1+1 max(G(1), T(1) + S).
def two_cores(split_s: float, spread: float):
    costs = PhaseCosts({1: split_s, 2: 10.0}, {1: 1.0, 2: 20.2}, {1: 0.0, 2: 0.0}, 0.5, spread)
    return decide(predict(costs, 2, overlaps("async", 1), 1, exact_mismatch=False), costs.spread)


def test_a_split_inside_the_spread_loses_to_colocated_and_the_line_says_so():
    """The quiet machine's smollm2_cpu.yaml at 64 sequences: both predicted 30.7 s/step, and
    the split ran 1.18x its prediction."""
    tie = two_cores(30.7, 0.0)
    assert tie.chosen.label == "colocated" and tie.runner_up.label == "split 1+1"
    assert tie.line() == "colocated: margin 0.0 s/step over split 1+1, spread 1.5 s/step (5%)"
    close = two_cores(29.7, 0.0)  # faster by 1.0, less than the least spread (5% of 30.7)
    assert close.close and close.chosen.label == "colocated"
    assert close.line() == (
        "colocated: split 1+1 is faster by a margin of 1.0 s/step, inside the spread of "
        "1.5 s/step (5%): the simpler placement wins"
    )
    clear = two_cores(27.0, 0.0)
    assert not clear.close and clear.chosen.label == "split 1+1"
    assert clear.line() == "split 1+1: margin 3.7 s/step over colocated, spread 1.5 s/step (5%)"


def test_the_measured_spread_widens_what_a_split_must_win_by():
    assert two_cores(27.0, MIN_SPREAD / 2).spread == MIN_SPREAD  # never below the least
    wide = two_cores(27.0, 0.2)  # repeated measurements 20% apart
    assert wide.spread_s == pytest.approx(0.2 * 30.7)
    assert wide.chosen.label == "colocated" and wide.close
    slower = two_cores(40.0, 0.0)  # colocated faster: margin over the split
    assert slower.chosen.label == "colocated" and slower.runner_up.label == "split 1+1"
    assert slower.margin_s == pytest.approx(-9.3) and not slower.close
    assert slower.line() == "colocated: margin 9.3 s/step over split 1+1, spread 2.0 s/step (5%)"


def test_one_core_has_colocated_alone():
    costs = PhaseCosts({1: 3.0}, {1: 4.0}, {1: 0.0}, 0.5)
    decision = decide(predict(costs, 1, True, 1, exact_mismatch=False), 0.0)
    assert decision.chosen.label == "colocated" and decision.runner_up is None
    assert not decision.close and decision.line() == "colocated: no split of one core"
    assert decision.margin_s == 0.0 and decision.spread_s == 0.0  # what pipeline.json records
