"""The cost model (forge/placement/cost_model.py) on made-up phase costs: each placement's
seconds per step and policy age, and the choice."""

import pytest

from forge.loop.config import overlaps
from forge.placement.cost_model import PhaseCosts, fastest, predict, table

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
    assert fastest(p.values()).label == "colocated"


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


def test_the_fastest_wins_and_the_table_marks_it():
    costs = PhaseCosts({1: 40.0, 3: 30.0, 4: 28.0}, {1: 50.0, 3: 20.0, 4: 16.0},
                       {1: 0.0, 3: 0.0, 4: 0.0}, 0.5)  # fmt: skip
    predictions = predict(costs, 4, overlaps("async", 1), 1, exact_mismatch=False)
    # Only the splits whose two sides were measured: 1+3 and 3+1.
    assert [p.label for p in predictions] == ["colocated", "split 1+3", "split 3+1"]
    best = fastest(predictions)
    assert best.label == "split 1+3" and best.seconds_per_step == 40.0
    lines = table(predictions, best).splitlines()
    assert [line.lstrip().startswith("*") for line in lines] == [False, True, False]


def test_a_tie_goes_to_colocated():
    costs = PhaseCosts({1: 10.0, 2: 5.0}, {1: 10.0, 2: 5.0}, {1: 0.0, 2: 0.0}, 0.0)
    assert (
        fastest(predict(costs, 2, overlaps("sync", 1), 1, exact_mismatch=False)).label
        == "colocated"
    )
