"""The cost model (the pipeline model): per-phase costs in, seconds per step and policy age
out, per placement.

A step of an RL run has two phases, generating a batch (rollouts: generate and score) and
training on it (then moving the generators to the new weights). With `cores` devices:

- colocated: both phases use all of them, taking turns: G(n) + T(n) + S, whether or not the
  run lets them overlap (an async run holds generation to the next batch: running further
  ahead would overlap nothing).
- split g + (n - g): the generator gets g cores, the trainer the rest. Where the phases do not
  overlap (sync mode, or async at max_policy_age 0) they alternate: G(g) + T(n - g) + S.
  Where they overlap (async, max_policy_age >= 1), the slower side sets the pace:
  max(G(g), T(n - g) + X(n - g) + S), where X is the exact mismatch pass the trainer adds on
  a batch one version old.

G, T and X come from `calibration.py`, measured at each core count on this machine; S is the
weight sync. Plain code, unit-tested on made-up costs.
"""

from dataclasses import dataclass

from forge.placement.plan import Layout


@dataclass(frozen=True)
class PhaseCosts:
    """Seconds of each phase of one step, by the number of cores it runs on.

    Args:
        generate_s: one batch's rollouts (generate and score).
        train_s: one training step on a batch of the current weights.
        stale_s: what the trainer's exact mismatch pass adds on a batch one version old.
        sync_s: publishing a weight version and moving the generator to it.
    """

    generate_s: dict[int, float]
    train_s: dict[int, float]
    stale_s: dict[int, float]
    sync_s: float


@dataclass(frozen=True)
class Prediction:
    """One placement and what the model says it costs."""

    placement: Layout
    generator_cores: int
    trainer_cores: int
    seconds_per_step: float
    policy_age: float  # mean versions between the weights that generated and that train

    @property
    def colocated(self) -> bool:
        return self.placement == "colocated"

    @property
    def label(self) -> str:
        """`colocated` or `split 1+1` (generator cores + trainer cores)."""
        if self.colocated:
            return "colocated"
        return f"split {self.generator_cores}+{self.trainer_cores}"


def predict(
    costs: PhaseCosts, cores: int, overlap: bool, max_policy_age: int, exact_mismatch: bool
) -> list[Prediction]:
    """Every placement of `cores` cores that `costs` covers: colocated, then each split.

    Args:
        overlap: whether a batch may be generated while the one before trains (async mode
            with max_policy_age >= 1: forge.loop.config.overlaps).
        max_policy_age: the staleness bound, which a training-bound split runs ahead to.
        exact_mismatch: whether the trainer adds its mismatch pass on a stale batch.
    """
    stale = exact_mismatch and overlap
    colocated = costs.generate_s[cores] + costs.train_s[cores] + costs.sync_s
    predictions = [Prediction("colocated", cores, cores, colocated, 0.0)]
    for g in range(1, cores):
        t = cores - g
        if g not in costs.generate_s or t not in costs.train_s:
            continue
        generate, train = costs.generate_s[g], costs.train_s[t] + costs.sync_s
        if not overlap:
            predictions.append(Prediction("split", g, t, generate + train, 0.0))
            continue
        train += costs.stale_s[t] if stale else 0.0
        # Training-bound, the buffer runs ahead up to the bound; generation-bound, each
        # batch was made while the one before trained.
        age = float(max_policy_age) if train >= generate else 1.0
        predictions.append(Prediction("split", g, t, max(generate, train), age))
    return predictions


def fastest(predictions: list[Prediction]) -> Prediction:
    """The placement predicted fastest; colocated wins a tie (no staleness)."""
    return min(predictions, key=lambda p: (p.seconds_per_step, not p.colocated))


def table(predictions: list[Prediction], chosen: Prediction) -> str:
    """One line per placement: predicted seconds per step and policy age, the choice marked."""
    return "\n".join(
        f"  {'*' if p == chosen else ' '} {p.label:<12} {p.seconds_per_step:7.1f} s/step"
        f"  policy age {p.policy_age:.1f}"
        for p in predictions
    )
