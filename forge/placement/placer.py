"""The placer: where generator and trainer run once they have started, and what that costs.

Built from the plan, it holds the colocated turns (handed to the handles the loop calls
generator and trainer through), fits the placement to the machine (`fit`: the cost model's
prediction from calibrated phase costs; under `placement: auto`, the processes moved onto
the split where it is predicted faster than colocated by more than the spread of the
measurements, else kept colocated), and compares the prediction with the steps measured
(`measured`). The loop calls only these; it never compares the placement itself.
"""

import functools
import json
import statistics
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Protocol

from forge.placement import calibration
from forge.placement.calibration import Movable, Workload
from forge.placement.cost_model import Decision, PhaseCosts, Prediction, decide, predict, table
from forge.placement.plan import Plan
from forge.placement.roles import Resources
from forge.placement.turns import Turns

MEASURED_STEPS = 3  # steps after the first whose median is printed beside the prediction
# A measured figure further than this from the prediction means the costs no longer describe
# the machine (its speed drifts between hours and days): they are dropped from the cache.
STALE_COSTS = 0.2


class Placed(Movable, Protocol):
    """A running role whose cores can be read and moved (the loop's handles)."""

    async def cpus(self) -> list[int]: ...


class Placer:
    """Generator and trainer as placed: their turns, their cores, and the prediction.

    Args:
        plan: the run's plan (forge.placement.plan).
        say: prints a line for the user.
        record: the JSON file the prediction and the measured figure go to (pipeline.json).
    """

    def __init__(self, plan: Plan, say: Callable[[str], None], record: Path) -> None:
        self.plan = plan
        self.say = say
        self.record = record
        self.turns = Turns(enabled=plan.colocated)  # the handles take them
        self.prediction: Prediction | None = None  # the placement's predicted cost
        self.decision: Decision | None = None  # under auto: the candidates, margin, spread
        self.costs_key: str | None = None  # the calibration cache entry it came from
        self.step_seconds: list[float] = []  # wall time of each step of this process
        # Cores generator and trainer were moved to after they started (auto placement).
        self.moved: dict[str, list[int]] | None = None

    @property
    def colocated(self) -> bool:
        """Whether generator and trainer share their devices now, taking turns."""
        return self.turns.enabled

    def max_policy_age(self, configured: int) -> int:
        """The staleness bound the placement allows: colocated phases take turns, so generating
        further ahead than the next batch would overlap nothing and only make the data older."""
        return 0 if self.colocated else configured

    def cores_of(self, role: str) -> list[int] | None:
        """The cores `role` was moved to after it started, for its respawns; None if it
        stayed where the plan put it."""
        return None if self.moved is None else self.moved[role]

    async def fit(
        self,
        generator: Placed,
        trainer: Placed,
        work: Workload,
        workload: tuple[Hashable, ...],
        *,
        overlap: bool,
        max_policy_age: int,
        exact_mismatch: bool,
    ) -> None:
        """Predicts the placement's seconds per step from the phase costs of this machine and
        `workload` (docs/placement.md); the cost model's arguments are `predict`'s.

        Under `placement: auto` on CPU, the costs are measured now (with `work`) unless
        cached, and generator and trainer move onto the placement `decide` chooses. An
        explicit placement is predicted when the costs are cached. The prediction and the
        choice are said, and written to `record`, where the measured figure joins them later.
        """
        auto = self.plan.auto
        if auto and not self.colocated:
            return  # auto kept the configured split (GPUs, several hosts): nothing to fit
        cpus = await generator.cpus()
        if not self.colocated:  # explicit split: the costs are for the cores of both
            cpus = sorted({*cpus, *await trainer.cpus()})
        options_of = functools.partial(
            predict,
            cores=len(cpus),
            overlap=overlap,
            max_policy_age=max_policy_age,
            exact_mismatch=exact_mismatch,
        )
        costs, source = await self._phase_costs(
            generator, trainer, work, workload, cpus, auto, options_of
        )
        if costs is None:
            return
        options = options_of(costs)
        self.prediction = choose(self.plan, options, costs.spread)
        if self.prediction is None:
            return
        self._report(costs, options, source)
        if auto:
            await self._apply(self.prediction, cpus, generator, trainer)

    def measured(self, step_seconds: float) -> None:
        """Takes the wall time of a step. After MEASURED_STEPS steps past the first, says their
        median beside the prediction (the first step also waits for the first batch), and
        drops the cached costs it came from where the step shows them wrong (`_wrong`)."""
        self.step_seconds.append(step_seconds)
        if self.prediction is None or len(self.step_seconds) != MEASURED_STEPS + 1:
            return
        measured = statistics.median(self.step_seconds[1:])
        predicted = self.prediction.seconds_per_step
        other = self.decision.runner_up if self.decision is not None else None
        beside = "" if other is None else f"; {other.label} predicted {other.seconds_per_step:.1f}"
        self.say(
            f"placement {self.prediction.label}: measured {measured:.1f} s/step (median of "
            f"{MEASURED_STEPS} steps), predicted {predicted:.1f} ({measured / predicted:.2f}x)"
            f"{beside}"
        )
        self._write({"measured_s_per_step": measured})
        why = self._wrong(measured)
        if why is not None:
            calibration.forget(self.costs_key)
            self.say(
                f"placement: {why}: the cached phase costs are dropped; the next auto run "
                "measures them"
            )

    def _wrong(self, measured: float) -> str | None:
        """Why the step `measured` shows the costs wrong, if it does: further than STALE_COSTS
        from their prediction, or (under auto) slower than the runner-up's prediction by more
        than the spread, so the runner-up would have been chosen had they held."""
        predicted = self.prediction.seconds_per_step
        if abs(measured / predicted - 1) > STALE_COSTS:
            return f"the step is more than {STALE_COSTS:.0%} off its prediction"
        other = self.decision.runner_up if self.decision is not None else None
        if other is not None and measured - other.seconds_per_step > self.decision.spread_s:
            return (
                f"{other.label}'s prediction is faster than the step measured by more than "
                f"the spread ({self.decision.spread_s:.1f} s/step)"
            )
        return None

    def _report(self, costs: PhaseCosts, options: list[Prediction], source: str) -> None:
        """Says the choice and every option's prediction, under auto with the margin and the
        spread it was decided by (kept in `decision`), and writes them to `record`."""
        chosen, decided = self.prediction.label, {}
        if self.plan.auto:
            self.decision = decide(options, costs.spread)
            chosen = self.decision.line()
            decided = {"margin_s": self.decision.margin_s, "spread_s": self.decision.spread_s}
        self.say(
            f"placement {'auto' if self.plan.auto else self.plan.placement} ({source}): "
            f"{chosen}\n" + table(options, self.prediction)
        )
        self._write(
            {
                "costs": vars(costs),
                "options": [vars(o) for o in options],
                "chosen": vars(self.prediction),
                **decided,
            }
        )

    def line(self) -> str:
        """Where generator and trainer run, said once `fit` has settled it."""
        if self.moved is not None:  # a core list each
            return (
                f"placement split: generator cores {self.moved['generator']}, trainer cores "
                f"{self.moved['trainer']}"
            )
        trainer = f"trainer {_describe(self.plan.resources('trainer'))}"
        if not self.plan.of_role("generator"):
            return f"placement: {trainer}, no generator"
        generator = f"generator {_describe(self.plan.resources('generator'))}"
        if self.colocated:
            return f"placement colocated (shared, taking turns): {generator}, {trainer}"
        return f"placement split: {generator}, {trainer}"

    async def _phase_costs(
        self,
        generator: Placed,
        trainer: Placed,
        work: Workload,
        workload: tuple[Hashable, ...],
        cpus: list[int],
        measure: bool,
        options_of: Callable[[PhaseCosts], list[Prediction]],
    ) -> tuple[PhaseCosts | None, str]:
        """The cached costs on `cpus`, else (if `measure`) measured now and cached unless
        disturbed; and where they came from. `options_of` predicts each placement."""
        key = self.costs_key = calibration.cache_key(workload, len(cpus))
        costs = calibration.load(key)
        if costs is not None or not measure:
            return costs, "cached"
        start = time.perf_counter()
        self.say(f"placement auto: calibrating on {len(cpus)} cores (cached once measured)")
        measured = await calibration.measure(
            generator, trainer, work, cpus, lambda c: decide(options_of(c), c.spread), self.say
        )
        await work.forget_records()  # the calibration's rollouts belong to no step
        took = f"calibrated in {time.perf_counter() - start:.0f}s"
        if measured.disturbed:
            return measured.costs, f"{took}, disturbed: not cached, the next run measures again"
        calibration.save(key, measured.costs)
        return measured.costs, took

    async def _apply(
        self, chosen: Prediction, cpus: list[int], generator: Placed, trainer: Placed
    ) -> None:
        """Moves generator and trainer onto `chosen`'s cores: a split gives the trainer the
        first cores and the generator the rest, and ends the turns."""
        if chosen.colocated:
            return
        t = chosen.trainer_cores
        self.moved = {"trainer": cpus[:t], "generator": cpus[t:]}  # respawns move there too
        await trainer.use_cores(self.moved["trainer"])
        await generator.use_cores(self.moved["generator"])
        self.turns.enabled = False

    def _write(self, update: dict[str, Any]) -> None:
        data = json.loads(self.record.read_text()) if self.record.exists() else {}
        self.record.write_text(json.dumps({**data, **update}, indent=1) + "\n")


def choose(plan: Plan, options: list[Prediction], spread: float) -> Prediction | None:
    """The option a run of `plan` takes (`Placer.fit`, and `forge plan` stars it): under
    `placement: auto` the one `decide` chooses, the measurements' relative `spread` apart;
    else the configured placement's, if the model covers it."""
    if plan.auto:
        return decide(options, spread).chosen
    if plan.colocated:
        return options[0]
    g, t = plan.resources("generator"), plan.resources("trainer")
    cores = (g.cpus_per_proc * g.procs, t.cpus_per_proc * t.procs)
    split = [o for o in options[1:] if (o.generator_cores, o.trainer_cores) == cores]
    return split[0] if split else None


def _describe(r: Resources) -> str:
    """`2 replicas x 1 proc (1 core each)`, `2 procs (GPUs)`, `1 proc (any core)`."""
    cores = f"{r.cpus_per_proc} core{'s' if r.cpus_per_proc > 1 else ''} each"
    where = "GPUs" if r.with_gpus else cores if r.cpus_per_proc else "any core"
    replicas = f"{r.num_replicas} replicas x " if r.num_replicas > 1 else ""
    return f"{replicas}{r.procs} proc{'s' if r.procs > 1 else ''} ({where})"
