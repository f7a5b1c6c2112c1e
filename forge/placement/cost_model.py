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
weight sync. `placement: auto` takes a split only where it is predicted faster than colocated
by more than the spread of the measurements (`decide`). Plain code, unit-tested on made-up
costs.
"""

from dataclasses import dataclass

from forge.placement.plan import Layout

# The least spread a margin must clear: two timings of one phase on a quiet machine differ by
# a few percent, and the model leaves out what the split's overlapping phases cost each other
# (memory bandwidth, caches), so a narrower margin is not told from noise even where the
# repeated measurements happened to agree.
MIN_SPREAD = 0.05


@dataclass(frozen=True)
class PhaseCosts:
    """Seconds of each phase of one step, by the number of cores it runs on.

    Args:
        generate_s: one batch's rollouts (generate and score).
        train_s: one training step on a batch of the current weights.
        stale_s: what the trainer's exact mismatch pass adds on a batch one version old.
        sync_s: publishing a weight version and moving the generator to it.
        spread: how far apart repeated measurements of one phase on one core count came: the
            largest (slowest - fastest) / fastest of generation and training; 0 where none
            was repeated.
    """

    generate_s: dict[int, float]
    train_s: dict[int, float]
    stale_s: dict[int, float]
    sync_s: float
    spread: float = 0.0


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


@dataclass(frozen=True)
class Decision:
    """Colocated against the fastest split: the choice `placement: auto` makes.

    Args:
        colocated: colocated's prediction.
        split: the fastest split's (the first of equals); None where the costs cover none.
        spread: the measurements' relative spread (`PhaseCosts.spread`), at least MIN_SPREAD.
    """

    colocated: Prediction
    split: Prediction | None
    spread: float

    @property
    def spread_s(self) -> float:
        """The spread in seconds per step, of the slower candidate's step."""
        if self.split is None:
            return 0.0
        return self.spread * max(self.colocated.seconds_per_step, self.split.seconds_per_step)

    @property
    def margin_s(self) -> float:
        """How much faster the split is predicted than colocated (negative: slower)."""
        if self.split is None:
            return 0.0
        return self.colocated.seconds_per_step - self.split.seconds_per_step

    @property
    def chosen(self) -> Prediction:
        """The split where it is predicted faster by more than the spread; else colocated,
        the simpler placement (no staleness, one phase at a time)."""
        if self.split is not None and self.margin_s > self.spread_s:
            return self.split
        return self.colocated

    @property
    def runner_up(self) -> Prediction | None:
        """The candidate not chosen; None where there is no split."""
        return self.colocated if self.chosen is self.split else self.split

    @property
    def close(self) -> bool:
        """Whether the candidates are predicted within the spread of each other."""
        return self.split is not None and abs(self.margin_s) <= self.spread_s

    def line(self) -> str:
        """The choice, the margin between the candidates and the spread of the measurements:
        `split 1+1: margin 3.1 s/step over colocated, spread 0.6 s/step (5%)`."""
        if self.split is None:
            return "colocated: no split of one core"
        spread = f"{self.spread_s:.1f} s/step ({self.spread:.0%})"
        if self.close and self.margin_s > 0:
            return (
                f"colocated: {self.split.label} is faster by a margin of {self.margin_s:.1f} "
                f"s/step, inside the spread of {spread}: the simpler placement wins"
            )
        chosen, other = self.chosen, self.runner_up
        return (
            f"{chosen.label}: margin {abs(self.margin_s):.1f} s/step over {other.label}, "
            f"spread {spread}"
        )


def decide(predictions: list[Prediction], spread: float) -> Decision:
    """Colocated (`predictions[0]`) against the fastest split, the measurements' relative
    `spread` floored at MIN_SPREAD."""
    split = min(predictions[1:], key=lambda p: p.seconds_per_step, default=None)
    return Decision(predictions[0], split, max(spread, MIN_SPREAD))


def table(predictions: list[Prediction], chosen: Prediction) -> str:
    """One line per placement: predicted seconds per step and policy age, the choice marked."""
    return "\n".join(
        f"  {'*' if p == chosen else ' '} {p.label:<12} {p.seconds_per_step:7.1f} s/step"
        f"  policy age {p.policy_age:.1f}"
        for p in predictions
    )
