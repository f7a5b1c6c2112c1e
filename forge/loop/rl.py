"""RLLoop: training on the run's own samples, asynchronously by default, bounded in staleness.

Rollout workers (several tasks): dataset row -> G episodes of the run's environment, their
turns sampled by the generators (forge.loop.rollouts; a single-turn task's episode is one
completion) -> `score` (the app's: rewards and advantages for GRPO, teacher logprobs for
distillation) -> replay buffer; an admission gate keeps at most (max_policy_age + 1) batches
ahead of the trainer. Training loop: buffer.sample -> trainer.train_step -> publish (trainer push ->
generator update). `mode: sync` alternates the two strictly (generate a batch, then train on
it): the baseline async mode is measured against, and the same data as async mode with
`max_policy_age: 0`.
"""

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from forge.actors.buffer import Sampled, left_buffer
from forge.controller.service import ReplicasLostError
from forge.data.admission import AdmissionGate
from forge.data.episode import Episode
from forge.envs.runner import EpisodeOutcome
from forge.loop.config import RLConfig, overlaps
from forge.loop.control_door import opened_door
from forge.loop.live_control import LiveControl
from forge.loop.live_settings import LiveKeyError
from forge.loop.rollouts import FAILED, record_outcomes
from forge.loop.run import Run
from forge.loop.startup import RunParts
from forge.loop.trainer_handle import TrainerDied
from forge.observability import Reduce, record_metric
from forge.observability.console import say
from forge.placement import load
from forge.placement.calibration import Workload

MAX_FAILURES_IN_A_ROW = 10


class RLLoop(Run):
    """Generate, score, buffer, train, publish. Subclasses implement `score`."""

    cfg: RLConfig

    def __init__(self, cfg: RLConfig, parts: RunParts) -> None:
        super().__init__(cfg, parts)
        self.buffer, self.dataset = parts.actors["buffer"], parts.actors["dataset"]
        self.groups = 0  # groups taken so far: group k gets prompt k and seed k
        self.in_flight: set[int] = set()  # groups taken, not yet in the buffer
        self.redo: list[int] = []  # groups whose rollout was stopped: taken again first
        self.delivering = asyncio.Lock()  # held while a group enters the buffer
        self.left_reported = 0  # episodes reported to the gate as gone from the buffer
        self.left_taken = 0  # those gone once the last batch was taken (reported after it)
        self.stop = asyncio.Event()
        self.gate = AdmissionGate(cfg.buffer.batch_size, cfg.buffer.max_policy_age, cfg.group_size)
        self.workers: list[asyncio.Future] = []
        self.deliveries: set[asyncio.Future] = set()  # scored groups on their way to the buffer
        self.step_ended = 0.0
        self.live = LiveControl(self)

    # --- placement ----------------------------------------------------------------------------

    async def begin(self) -> None:
        await super().begin()
        bound = self.placer.max_policy_age(self.gate.max_policy_age)
        if self.cfg.asynchronous and bound < self.gate.max_policy_age:
            self.gate.lower_max_policy_age(bound)  # colocated: async runs as sync does
        # Batches may be a version old: the generators' move need not hold up the trainer.
        self.sync.overlap = overlaps(self.cfg.mode, self.gate.max_policy_age)
        self._exits.callback(self.live.close)
        await self._exits.enter_async_context(
            opened_door(self.run_dir, self.cfg.control, self.live.calls())
        )

    async def fit_placement(self) -> None:
        """The placer predicts the placement's cost on this machine and, under
        `placement: auto`, moves generator and trainer onto the one it chooses (`Placer.fit`);
        calibration runs this run's own rollouts, training passes and weight syncs, and reads
        the machine's load around them where the run's processes are this one's children."""
        cfg = self.cfg
        work = Workload(
            rollouts=self._calibration_rollouts,
            train_costs=self._train_costs,
            sync_away=lambda: self.sync.away(self.version + 1),
            sync_back=lambda: self.sync.sync(self.version),
            forget_records=self.logs.discard,
            read_load=None if cfg.provisioner.host_launcher().spans_nodes else load.read,
        )
        age = cfg.buffer.max_policy_age
        await self.placer.fit(
            self.generator,
            self.trainer,
            work,
            cfg.workload(),
            overlap=overlaps(cfg.mode, age),
            max_policy_age=age,
            exact_mismatch=cfg.trainer.exact_mismatch,
        )

    async def _calibration_rollouts(self, groups: int | None, seed_base: int) -> list[Episode]:
        """One batch of the run's rollouts (or `groups` groups), scored, seeds from
        `seed_base`."""
        cfg = self.cfg
        groups = groups or cfg.buffer.batch_size // cfg.group_size

        async def one(group: int) -> list[Episode]:
            try:
                return await self.play_row(group, seed_base + group * cfg.group_size)
            except GroupFailed:
                return []  # a group a run would drop is not timed either

        return [e for group in await asyncio.gather(*map(one, range(groups))) for e in group]

    async def _train_costs(self, episodes: list[Episode]) -> dict[str, float]:
        """The trainer's timed passes on `episodes`, dealt to its data-parallel ranks."""
        return await self.trainer.calibrate([episodes[r :: self.world] for r in range(self.world)])

    # --- rollouts -----------------------------------------------------------------------------

    async def score(self, group: int, row: dict, outcomes: list[EpisodeOutcome]) -> list[Episode]:
        """The group's episodes, ready to train on (the app's objective decides what that is);
        each outcome's trajectory is what was sampled, its reward what the environment gave plus,
        where the app rewards its rollouts (`REWARDS_ROLLOUTS`), the reward functions' scores."""
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
        self.left_reported = self.left_taken = left_buffer(stats)
        self.gate.restore(stats["size"])

    async def rollout(self, group: int) -> list[Episode]:
        """One row, G episodes, scored by the app.

        Raises:
            GroupFailed: an episode was cut short by its environment (it raised or hung); the
                whole group is dropped, so its advantages never rest on a partial group.
        """
        seed = self.cfg.seed * 1_000_003 + group * self.cfg.group_size
        # Scoring in the same turn: a teacher model's pass must not run while a colocated
        # trainer does.
        async with self.generator.turn():
            return await self.play_row(group, seed)

    async def play_row(self, group: int, seed: int) -> list[Episode]:
        """Group `group`'s episodes: dataset row `group`, played and scored (`play_group`)."""
        row = await self.dataset.nth.route(group)
        episodes = await self.play_group(group, row, seed)
        for episode in episodes:
            episode.row = row["index"]
        return episodes

    async def play_group(self, group: int, row: dict, seed: int) -> list[Episode]:
        """The row's G episodes, counted under `env/` and scored by the app; GroupFailed if
        one was cut short by its environment."""
        start = time.perf_counter()
        sampling = self.live.sampling or None  # changed live (forge.loop.live_control)
        outcomes = await self.rollouts.play(row, self.cfg.group_size, sampling, seed)
        played = time.perf_counter()
        record_metric("rollout/generate_s", played - start, Reduce.SUM)
        record_outcomes(outcomes)
        failed = [o for o in outcomes if o.status in FAILED]
        if failed:
            raise GroupFailed(
                f"{len(failed)} of its {len(outcomes)} episodes ended by the environment "
                f"({failed[0].status}: {failed[0].error}); the group is dropped"
            )
        if self.cfg.REWARDS_ROLLOUTS:
            failures = await self.rollouts.score([row] * len(outcomes), outcomes)
            record_metric("rollout/reward_failures", failures, Reduce.SUM)
        episodes = await self.score(group, row, outcomes)
        record_metric("rollout/score_s", time.perf_counter() - played, Reduce.SUM)
        return episodes

    async def rollout_worker(self) -> None:
        """Starts a rollout whenever the admission gate allows one, until the run stops.

        One failed group is counted and skipped; failures in a row back off, and after
        MAX_FAILURES_IN_A_ROW the run ends with the last error rather than spin.
        """
        failures = 0
        while not self.stop.is_set():
            await self.live.running.wait()  # paused by an attacher
            await self.gate.admit()
            group = self.take_group()
            try:
                episodes = await self.rollout(group)
            except (asyncio.CancelledError, ReplicasLostError):
                # Stopped (stop_rollouts) or nothing left to generate with (its host lost):
                # the group is taken again later, by this run or its resumption.
                self.in_flight.discard(group)
                self.redo.append(group)
                await self.gate.finished(self.cfg.group_size, kept=0)
                raise
            except Exception as e:
                self.in_flight.discard(group)
                await self.gate.finished(self.cfg.group_size, kept=0)
                failures += 1
                _report_failed(group, e, failures)
                with contextlib.suppress(TimeoutError):  # a back-off that a stop ends
                    await asyncio.wait_for(self.stop.wait(), min(2.0**failures, 30.0))
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
        """Generates exactly one batch, all on the current weights (the synchronous baseline);
        a group whose rollout failed is counted and replaced by the next one, until
        MAX_FAILURES_IN_A_ROW failures with no success between them."""
        start = time.perf_counter()
        wanted, failures = self.cfg.buffer.batch_size // self.cfg.group_size, 0
        batches: list[list[Episode]] = []
        while len(batches) < wanted:
            groups = [self.take_group() for _ in range(wanted - len(batches))]
            results = await asyncio.gather(*map(self.rollout, groups), return_exceptions=True)
            for group, result in zip(groups, results, strict=True):
                if not isinstance(result, BaseException):
                    batches.append(result)
                    failures = 0
                    continue
                # Cancelled (the run is stopping), or nothing left to generate with.
                if not isinstance(result, Exception) or isinstance(result, ReplicasLostError):
                    raise result
                self.in_flight.discard(group)
                failures += 1
                _report_failed(group, result, failures)
        await self.buffer.add.call_one([e for b in batches for e in b])
        self.in_flight.clear()
        record_metric("rollout/batch_s", time.perf_counter() - start)

    # --- training -----------------------------------------------------------------------------

    async def train_step(self, step: int) -> dict[str, float]:
        """Waits for a fresh batch, trains on it, and moves every generator to the new weights."""
        waited = time.perf_counter()
        sampled = await self.next_batch()
        # Whatever order concurrent groups finished in, train on them in a fixed order.
        batch = [
            sorted(rank, key=lambda e: tuple(map(int, e.episode_id.split("-"))))
            for rank in sampled.batch
        ]
        record_metric("train/batch_wait_s", time.perf_counter() - waited)
        self.logs.batch(step, self.version, batch)
        self.live.trained(step, batch)
        async with self.trainer.turn():  # the step and the generators' update: one turn
            start = time.perf_counter()
            metrics = await self.train(batch, policy_version=self.version)
            busy = time.perf_counter() - start + await self.sync.publish(step, self.version)
        await self.report_left(self.left_taken)
        wall = time.perf_counter() - waited
        # Idle: waiting for a batch, or for the generators to take new weights.
        record_metric("train/idle_fraction", 1 - busy / wall)
        record_metric("train/step_s", wall)
        _record_buffer(sampled.stats)
        return metrics

    async def next_batch(self) -> Sampled:
        """The buffer's next batch for the trainer's version, waited for; groups evicted
        meanwhile are reported to the gate at once, so rollouts refill the buffer.

        Raises:
            TimeoutError: no batch within `buffer.sample_timeout_s`, naming what the buffer
                and the gate hold.
            Exception: a rollout worker's error, if one failed while the trainer waited.
        """
        deadline = time.monotonic() + self.cfg.buffer.sample_timeout_s
        while (sampled := await self._sample(deadline - time.monotonic())).batch is None:
            await self.report_left(sampled.left)
            if not self.live.running.is_set():  # paused: waiting is what was asked
                deadline = time.monotonic() + self.cfg.buffer.sample_timeout_s
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no batch of {self.cfg.buffer.batch_size} episodes for policy version "
                    f"{self.version} within buffer.sample_timeout_s "
                    f"{self.cfg.buffer.sample_timeout_s}s: the buffer holds "
                    f"{sampled.stats['size']}, the gate counts {self.gate.buffered} buffered and "
                    f"{self.gate.in_flight} in flight"
                )
        self.left_taken = sampled.left  # reported once the new weights are on the generators
        return sampled

    async def _sample(self, wait_s: float) -> Sampled:
        """The buffer's `sample`, unless a rollout worker fails first: its error is raised."""
        call = asyncio.ensure_future(
            self.buffer.sample.call_one(
                self.version, wait_s=max(wait_s, 0.0), known_left=self.left_reported
            )
        )
        await asyncio.wait([call, *self.workers], return_when=asyncio.FIRST_COMPLETED)
        if not call.done():
            call.cancel()
            _raise_if_failed(self.workers)
            raise RuntimeError("the rollout workers stopped while the trainer waited for a batch")
        return call.result()

    async def report_left(self, left: int) -> None:
        """Tells the gate that the buffer's episodes that ever left it (trained for the last
        time, or evicted) are `left`, making room for rollouts."""
        if self.cfg.asynchronous and left > self.left_reported:
            await self.gate.consumed(left - self.left_reported)
        self.left_reported = max(left, self.left_reported)

    async def restart_trainer(self, error: TrainerDied) -> None:
        await super().restart_trainer(error)
        # The batch the dead trainer took is gone; the generators are on the restored weights.
        await self.report_left(self.left_taken)

    async def run(self) -> None:
        try:
            await self.steps(self.last_step - self.version)
        finally:
            await self.stop_rollouts()

    async def close(self) -> None:
        """Stops the rollouts (their groups are taken again on resume), then closes the run,
        even where a delivery in flight failed (a dead replay buffer): its processes are
        stopped and its shared memory given back either way."""
        try:
            if self.workers:
                await self.stop_rollouts()
        finally:
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
        logged: list[dict[str, float]] = []  # of steps first + 1, first + 2, ...
        self.step_ended = time.perf_counter()
        first = self.version
        target = first + n
        while self.version < target:
            step = self.version + 1
            await self.live.boundary(step)
            if self.live.stopping:
                say(f"stopped by an attacher after step {self.version}: the same command resumes")
                break
            try:
                if not self.cfg.asynchronous:
                    await self.sync_rollouts()
                await self.train_step(step)
                record_metric("generator/idle_fraction", self.rollouts.busy.idle_fraction())
                logged.append(await self.log_step(step, self.started))
                # After the step's row: killed in between, the run resumes from the previous
                # checkpoint and takes the step again, rather than with the step's row lost.
                await self.lifecycle.checkpoint(step, self.state_dict)
            except TrainerDied as e:
                await self.restart_trainer(e)  # back at its checkpoint: those steps again
                del logged[max(0, self.version - first) :]  # the rows of steps to redo
                first = min(first, self.version)
                continue
            self.placer.measured(time.perf_counter() - self.step_ended)
            self.step_ended = time.perf_counter()
            if on_step is not None:
                on_step(step, logged[-1])
        return logged

    # --- live control -------------------------------------------------------------------------

    def scalable(self, role: str) -> Any | None:
        """The service of `role` that live control may scale, if the run has one."""
        if role == "generator":
            return self.generator.service
        return self.rollouts.environments if role == "environment" else None

    def check_max_policy_age(self, age: int) -> None:
        """Refuses a `buffer.max_policy_age` this run cannot take live.

        Raises:
            LiveKeyError: a sync run, a colocated placement (it runs async as sync), or an age
                with which the admission gate could stall.
        """
        if not self.cfg.asynchronous:
            raise LiveKeyError("buffer.max_policy_age: a sync run trains each batch it made")
        if self.placer.max_policy_age(age) < age:
            raise LiveKeyError("buffer.max_policy_age: colocated, async runs as sync here")
        try:
            AdmissionGate(self.cfg.buffer.batch_size, age, self.cfg.group_size)
        except ValueError as e:
            raise LiveKeyError(f"buffer.max_policy_age={age}: {e}") from None

    async def set_max_policy_age(self, age: int) -> None:
        """The staleness bound, changed in the gate, the buffer and the weight sync; rollout
        workers are added where the gate lets more groups be ahead."""
        await self.gate.set_max_policy_age(age)
        await self.buffer.set_max_policy_age.call_one(age)
        self.sync.overlap = overlaps(self.cfg.mode, age)
        if self.workers:
            more = self.gate.limit // self.cfg.group_size - len(self.workers)
            self.workers += [asyncio.ensure_future(self.rollout_worker()) for _ in range(more)]

    async def stop_rollouts(self) -> None:
        """Stops the rollout workers. A group still being generated or scored is dropped (the
        gate forgets it); one already scored reaches the buffer first."""
        self.stop.set()
        for w in self.workers:
            w.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)
        await asyncio.gather(*self.deliveries)
        self.workers = []


class GroupFailed(RuntimeError):
    """A group's rollout that cannot be trained on: the rollout worker counts it and goes on."""


def _report_failed(group: int, error: Exception, failures: int) -> None:
    """Counts and reports a failed group's rollout; raises after MAX_FAILURES_IN_A_ROW."""
    record_metric("rollout/failed_groups", 1, Reduce.SUM)
    message = str(error).splitlines()[0] if str(error) else repr(error)
    say(f"rollout of group {group} failed ({failures} in a row): {message}")
    if failures >= MAX_FAILURES_IN_A_ROW:
        raise RuntimeError(f"{failures} rollouts failed in a row: {message}") from error


def _record_buffer(stats: dict[str, Any]) -> None:
    """The buffer's size and running totals once a batch was taken, and that batch's ages."""
    record_metric("buffer/size", stats["size"])
    for key in ("evicted_stale", "evicted_newer", "groups_dropped"):  # running totals
        record_metric(f"buffer/{key}", stats[key], Reduce.MAX)
    for key in ("policy_age_min", "policy_age_mean", "policy_age_max"):
        record_metric(f"buffer/{key}", stats[key] or 0)


def _raise_if_failed(workers: list[asyncio.Future]) -> None:
    for w in workers:
        if w.done() and not w.cancelled() and w.exception() is not None:
            raise w.exception()
