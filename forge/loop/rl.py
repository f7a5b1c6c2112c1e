"""RLLoop: training on the run's own samples, asynchronously by default, bounded in staleness.

Rollout workers (several tasks): dataset row -> generator.generate (G samples of one prompt)
-> `score` (the app's: rewards and advantages for GRPO, teacher logprobs for distillation) ->
replay buffer; an admission gate keeps at most (max_policy_age + 1) batches ahead of the
trainer. Training loop: buffer.sample -> trainer.train_step -> publish (trainer push ->
generator update). `mode: sync` alternates the two strictly (generate a batch, then train on
it): the baseline async mode is measured against, and the same data as async mode with
`max_policy_age: 0`.
"""

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from forge.data.admission import AdmissionGate
from forge.data.completion import Completion
from forge.data.episode import Episode
from forge.loop import calibration
from forge.loop.config import RLConfig, overlaps
from forge.loop.pipeline import Prediction, fastest, predict, table
from forge.loop.run import Run
from forge.loop.trainer_handle import TrainerDied
from forge.observability import Reduce, record_metric
from forge.observability.console import say

MAX_FAILURES_IN_A_ROW = 10
MEASURED_STEPS = 3  # steps after the first whose median is printed beside the prediction
# A measured figure further than this from the prediction means the costs no longer describe
# the machine (its speed drifts between hours and days): they are dropped from the cache.
STALE_COSTS = 0.2


class RLLoop(Run):
    """Generate, score, buffer, train, publish. Subclasses implement `score`."""

    cfg: RLConfig

    def __init__(self, cfg: RLConfig) -> None:
        super().__init__(cfg)
        self.groups = 0  # groups taken so far: group k gets prompt k and seed k
        self.in_flight: set[int] = set()  # groups taken, not yet in the buffer
        self.redo: list[int] = []  # groups whose rollout was stopped: taken again first
        self.delivering = asyncio.Lock()  # held while a group enters the buffer
        self.left_reported = 0  # episodes reported to the gate as gone from the buffer
        self.stop = asyncio.Event()
        self.busy = BusyClock()  # time with at least one generate call running
        self.gate = AdmissionGate(cfg.buffer.batch_size, cfg.buffer.max_policy_age, cfg.group_size)
        self.workers: list[asyncio.Future] = []
        self.deliveries: set[asyncio.Future] = set()  # scored groups on their way to the buffer
        self.prediction: Prediction | None = None  # the placement's predicted cost
        self.costs_key: str | None = None  # the calibration cache entry it came from
        self.step_seconds: list[float] = []  # wall time of each step of this process
        self.step_ended = 0.0

    async def attach(self, actors: dict[str, Any]) -> None:
        """The replay buffer and the dataset; apps call this first when they add their own."""
        self.buffer, self.dataset = actors["buffer"], actors["dataset"]

    # --- placement ----------------------------------------------------------------------------

    async def start(self) -> "RLLoop":
        await super().start()
        if self.turns.enabled and self.cfg.asynchronous:
            # Colocated phases take turns: generating further ahead than the next batch would
            # overlap nothing and only make the data older. Async runs as sync does.
            self.gate.lower_max_policy_age(0)
        # Batches may be a version old: the generators' move need not hold up the trainer.
        self.overlap_updates = overlaps(self.cfg.mode, self.gate.max_policy_age)
        return self

    async def fit_placement(self) -> None:
        """Predicts the placement's seconds per step from the phase costs of this machine and
        workload (docs/placement.md).

        Under `placement: auto` on CPU, the costs are measured now unless cached, and generator
        and trainer move onto the placement predicted fastest. An explicit placement is
        predicted when the costs are cached. The prediction and the choice are printed, and
        written to run_dir/pipeline.json, where the measured figure joins them later.
        """
        cfg, auto = self.cfg, self.plan.auto
        if auto and not self.turns.enabled:
            return  # auto kept the configured split (GPUs, several hosts): nothing to fit
        cpus = (await self.generator.cores.fanout())[0]["cpus"]
        if not self.turns.enabled:  # explicit split: the costs are for the cores of both
            cpus = sorted({*cpus, *(await self.trainer.cores())["cpus"]})
        costs, source = await self._phase_costs(cpus, measure=auto)
        if costs is None:
            return
        exact = cfg.trainer.exact_mismatch
        options = predict(costs, len(cpus), cfg.mode, cfg.buffer.max_policy_age, exact)
        self.prediction = fastest(options) if auto else self._configured(options)
        if self.prediction is None:
            return
        if auto:
            await self._apply(self.prediction, cpus)
        say(
            f"placement {cfg.placement} ({source}): {self.prediction.label}\n"
            + table(options, self.prediction)
        )
        self._write_pipeline(
            {
                "costs": vars(costs),
                "options": [vars(o) for o in options],
                "chosen": vars(self.prediction),
            }
        )

    async def _phase_costs(self, cpus: list[int], measure: bool) -> tuple[Any, str]:
        """The cached costs on `cpus`, else (if `measure`) measured now and cached; and
        where they came from."""
        key = self.costs_key = calibration.cache_key(self.cfg, len(cpus))
        costs = calibration.load(key)
        if costs is not None or not measure:
            return costs, "cached"
        start = time.perf_counter()
        say(f"placement auto: calibrating on {len(cpus)} cores (cached once measured)")
        costs = await calibration.measure(self, cpus)
        calibration.save(key, costs)
        await self.logger.discard()  # the calibration's rollouts belong to no step
        return costs, f"calibrated in {time.perf_counter() - start:.0f}s"

    def _configured(self, options: list[Prediction]) -> Prediction | None:
        """The prediction of the placement the config sets, if the model covers it."""
        if self.turns.enabled:
            return options[0]
        g, t = self.plan.resources("generator"), self.plan.resources("trainer")
        cores = (g.cpus_per_proc * g.procs, t.cpus_per_proc * t.procs)
        split = [o for o in options[1:] if (o.generator_cores, o.trainer_cores) == cores]
        return split[0] if split else None

    async def _apply(self, chosen: Prediction, cpus: list[int]) -> None:
        """Moves generator and trainer onto `chosen`'s cores: a split gives the trainer the
        first cores and the generator the rest, and ends the turns."""
        if chosen.colocated:
            return
        t = chosen.trainer_cores
        self.cores = {"trainer": cpus[:t], "generator": cpus[t:]}  # respawns move there too
        await self.trainer.use_cores(self.cores["trainer"])
        await self.generator.use_cores.fanout(self.cores["generator"])
        self.turns.enabled = False

    def _report_measured(self) -> None:
        """After MEASURED_STEPS steps past the first, prints their median beside the
        prediction (the first step also waits for the first batch); drops the cached costs
        it came from when the two are more than STALE_COSTS apart."""
        if self.prediction is None or len(self.step_seconds) != MEASURED_STEPS + 1:
            return
        measured = statistics.median(self.step_seconds[1:])
        predicted = self.prediction.seconds_per_step
        say(
            f"placement {self.prediction.label}: measured {measured:.1f} s/step (median of "
            f"{MEASURED_STEPS} steps), predicted {predicted:.1f} ({measured / predicted:.2f}x)"
        )
        self._write_pipeline({"measured_s_per_step": measured})
        if abs(measured / predicted - 1) > STALE_COSTS:
            calibration.forget(self.costs_key)
            say("placement: the cached phase costs are dropped; the next auto run measures them")

    def _write_pipeline(self, update: dict[str, Any]) -> None:
        path = self.run_dir / "pipeline.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**data, **update}, indent=1) + "\n")

    # --- rollouts -----------------------------------------------------------------------------

    async def score(self, group: int, row: dict, completions: list[Completion]) -> list[Episode]:
        """The group's episodes, ready to train on (the app's objective decides what that is)."""
        raise NotImplementedError

    def take_group(self) -> int:
        """The next group's number k: it gets dataset row k and sampling seed k. A group whose
        rollout was stopped (by `stop_rollouts`, or a crash after a checkpoint) comes first."""
        if self.redo:
            group = self.redo.pop(0)
        else:
            group, self.groups = self.groups, self.groups + 1
        self.in_flight.add(group)
        return group

    async def state_dict(self) -> dict[str, Any]:
        """The dataset position (groups taken, groups to take again, which rows), and the
        replay buffer."""
        async with self.delivering:  # no group enters the buffer while it is read
            return {
                "data": [self.data.name, self.data.fingerprint],
                "groups": self.groups,
                "redo": sorted(self.in_flight | set(self.redo)),
                "buffer": await self.buffer.state_dict.call_one(),
            }

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.check_same_rows(*state["data"])  # group k is row k of the same rows
        self.groups, self.redo = state["groups"], list(state["redo"])
        await self.buffer.load_state_dict.call_one(state["buffer"])
        # Buffered episodes count against the admission gate as they did before the stop.
        stats = await self.buffer.stats.call_one()
        self.left_reported = _left_buffer(stats)
        self.gate.restore(stats["size"])

    async def rollout(self, group: int) -> list[Episode]:
        """One prompt, G samples, scored by the app."""
        row = await self.dataset.nth.call_one(group)
        seed = self.cfg.seed * 1_000_003 + group * self.cfg.group_size
        # Scoring too: a teacher model's pass must not run while a colocated trainer does.
        async with self.turns.generating():
            async with self.busy:
                completions = await self.generator.generate.route(
                    row["prompt"], n=self.cfg.group_size, sampling={"seed": seed}
                )
            episodes = await self.score(group, row, completions)
        for episode in episodes:
            episode.row = row["index"]
        return episodes

    async def rollout_worker(self) -> None:
        """Starts a rollout whenever the admission gate allows one, until the run stops.

        One failed group is counted and skipped; failures in a row back off, and after
        MAX_FAILURES_IN_A_ROW the run ends with the last error rather than spin.
        """
        failures = 0
        while not self.stop.is_set():
            await self.gate.admit()
            group = self.take_group()
            try:
                episodes = await self.rollout(group)
            except asyncio.CancelledError:  # stop_rollouts: the group is taken again later
                self.in_flight.discard(group)
                self.redo.append(group)
                await self.gate.finished(self.cfg.group_size, kept=0)
                raise
            except Exception as e:
                self.in_flight.discard(group)
                await self.gate.finished(self.cfg.group_size, kept=0)
                record_metric("rollout/failed_groups", 1, Reduce.SUM)
                failures += 1
                message = str(e).splitlines()[0] if str(e) else repr(e)
                say(f"rollout of group {group} failed ({failures} in a row): {message}")
                if failures >= MAX_FAILURES_IN_A_ROW:
                    raise RuntimeError(f"{failures} rollouts failed in a row: {message}") from e
                await asyncio.sleep(min(2.0**failures, 30.0))
                continue
            failures = 0
            # Shielded: once scored, a group reaches the buffer and the gate's count even if
            # the workers are stopped meanwhile (stop_rollouts waits for it).
            delivery = asyncio.ensure_future(self.deliver(group, episodes))
            self.deliveries.add(delivery)
            delivery.add_done_callback(self.deliveries.discard)
            await asyncio.shield(delivery)

    async def deliver(self, group: int, episodes: list[Episode]) -> None:
        """Puts a finished group in the buffer and tells the gate."""
        async with self.delivering:
            await self.buffer.add.call_one(episodes)
            self.in_flight.discard(group)
        await self.gate.finished(len(episodes))

    async def sync_rollouts(self) -> None:
        """Generates exactly one batch, all on the current weights (the synchronous baseline)."""
        start = time.perf_counter()
        groups = [
            self.take_group() for _ in range(self.cfg.buffer.batch_size // self.cfg.group_size)
        ]
        batches = await asyncio.gather(*(self.rollout(g) for g in groups))
        await self.buffer.add.call_one([e for b in batches for e in b])
        self.in_flight.difference_update(groups)
        record_metric("rollout/batch_s", time.perf_counter() - start)

    # --- training -----------------------------------------------------------------------------

    async def train_step(self, step: int) -> dict[str, float]:
        """Waits for a fresh batch, trains on it, and moves every generator to the new weights."""
        waited = time.perf_counter()
        while (batch := await self.buffer.sample.call_one(self.version)) is None:
            _raise_if_failed(self.workers)
            # Evicted groups make room for the rollouts that refill the buffer.
            await self.report_consumed()
            await asyncio.sleep(0.05)
        # Whatever order concurrent groups finished in, train on them in a fixed order.
        batch = [
            sorted(rank, key=lambda e: tuple(map(int, e.episode_id.split("-")))) for rank in batch
        ]
        self.log_batch(step, self.version, batch)
        async with self.turns.training():
            start = time.perf_counter()
            metrics = await self.train(batch, policy_version=self.version)
            busy = time.perf_counter() - start + await self.publish(step)
        after = await self.report_consumed()
        wall = time.perf_counter() - waited
        # Idle: waiting for a batch, or for the generators to take new weights.
        record_metric("train/idle_fraction", 1 - busy / wall)
        record_metric("train/step_s", wall)
        record_metric("buffer/size", after["size"])
        for key in ("evicted_stale", "evicted_newer", "groups_dropped"):  # running totals
            record_metric(f"buffer/{key}", after[key], Reduce.MAX)
        for key in ("policy_age_min", "policy_age_mean", "policy_age_max"):
            record_metric(f"buffer/{key}", after[key] or 0)
        return metrics

    async def report_consumed(self) -> dict[str, Any]:
        """Tells the gate which episodes left the buffer since the last report (trained for the
        last time, or evicted), making room for rollouts; returns the buffer's stats."""
        stats = await self.buffer.stats.call_one()
        if self.cfg.asynchronous:
            await self.gate.consumed(_left_buffer(stats) - self.left_reported)
            self.left_reported = _left_buffer(stats)
        return stats

    async def restart_trainer(self, error: TrainerDied) -> None:
        await super().restart_trainer(error)
        # The batch the dead trainer took is gone; the generators are on the restored weights.
        await self.report_consumed()

    async def run(self) -> None:
        try:
            await self.steps(self.last_step - self.version)
        finally:
            await self.stop_rollouts()

    async def close(self) -> None:
        """Stops the rollouts (their groups are taken again on resume), then closes the run."""
        if self.workers:
            await self.stop_rollouts()
        await super().close()

    async def steps(
        self, n: int, on_step: Callable[[int, dict[str, float]], None] | None = None
    ) -> list[dict[str, float]]:
        """Trains `n` more steps and returns each step's logged metrics.

        In async mode the rollout workers start with the first call and keep generating
        between calls, as far ahead as the admission gate allows, until `stop_rollouts`;
        a later call starts them again. `on_step(step, metrics)` runs after each step (a
        notebook redraws a plot there).
        """
        if self.cfg.asynchronous and not self.workers:
            self.stop.clear()
            ahead = self.gate.limit // self.cfg.group_size
            self.workers = [asyncio.ensure_future(self.rollout_worker()) for _ in range(ahead)]
        logged = []
        self.step_ended = time.perf_counter()
        target = self.version + n
        while self.version < target:
            step = self.version + 1
            try:
                if not self.cfg.asynchronous:
                    await self.sync_rollouts()
                await self.train_step(step)
                await self.checkpoint(step)
            except TrainerDied as e:
                await self.restart_trainer(e)  # back at its checkpoint: those steps again
                continue
            record_metric("generator/idle_fraction", self.busy.idle_fraction())
            logged.append(await self.log_step(step, self.started))
            self.step_seconds.append(time.perf_counter() - self.step_ended)
            self.step_ended = time.perf_counter()
            self._report_measured()
            if on_step is not None:
                on_step(step, logged[-1])
        return logged

    async def stop_rollouts(self) -> None:
        """Stops the rollout workers. A group still being generated or scored is dropped (the
        gate forgets it); one already scored reaches the buffer first."""
        self.stop.set()
        for w in self.workers:
            w.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)
        await asyncio.gather(*self.deliveries)
        self.workers = []


class BusyClock:
    """Measures the fraction of time with at least one call inside `async with`."""

    def __init__(self) -> None:
        self.inside = 0
        self.busy = 0.0
        self.since = self.start = time.perf_counter()

    async def __aenter__(self) -> None:
        if self.inside == 0:
            self.since = time.perf_counter()
        self.inside += 1

    async def __aexit__(self, *exc: object) -> None:
        self.inside -= 1
        if self.inside == 0:
            self.busy += time.perf_counter() - self.since

    def busy_seconds(self) -> float:
        """Seconds with at least one call inside so far."""
        return self.busy + (time.perf_counter() - self.since if self.inside else 0.0)

    def idle_fraction(self) -> float:
        elapsed = time.perf_counter() - self.start
        return 1 - self.busy_seconds() / max(elapsed, 1e-9)


def _left_buffer(stats: dict[str, Any]) -> int:
    return stats["retired"] + stats["evicted_stale"] + stats["evicted_capacity"]


def _raise_if_failed(workers: list[asyncio.Future]) -> None:
    for w in workers:
        if w.done() and not w.cancelled() and w.exception() is not None:
            raise w.exception()
