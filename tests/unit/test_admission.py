"""AdmissionGate: the (A + 1) * B bound, waits with deadlines, and the policy-age invariant."""

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import pytest
from helper_runs import wait_until

from forge.actors.buffer import EpisodeBuffer, ReplayBufferConfig
from forge.data import Completion, Episode
from forge.data.admission import AdmissionGate


def test_sync_mode_allows_exactly_one_batch_ahead():
    gate = AdmissionGate(batch_size=8, max_policy_age=0, group_size=4)
    assert gate.limit == 8
    assert [gate.try_admit() for _ in range(3)] == [True, True, False]
    assert (gate.in_flight, gate.buffered, gate.ahead) == (8, 0, 8)


async def test_room_comes_back_only_when_samples_are_consumed():
    gate = AdmissionGate(batch_size=8, max_policy_age=1, group_size=4)
    assert sum(gate.try_admit() for _ in range(5)) == 4  # (1 + 1) * 8 = 16 samples
    await gate.finished(16)
    assert (gate.in_flight, gate.buffered) == (0, 16) and not gate.try_admit()
    await gate.consumed(8)
    assert gate.try_admit() and gate.try_admit() and not gate.try_admit()


async def test_a_restored_gate_counts_the_buffer_it_resumes_with():
    gate = AdmissionGate(batch_size=8, max_policy_age=1, group_size=4)
    gate.restore(12)
    assert (gate.in_flight, gate.buffered) == (0, 12) and gate.try_admit()
    assert not gate.try_admit()  # 12 + 4 = 16, the limit
    with pytest.raises(ValueError, match="already counts 16"):
        gate.restore(0)


async def test_a_dropped_group_frees_its_room():
    gate = AdmissionGate(batch_size=4, max_policy_age=0, group_size=4)
    assert gate.try_admit()
    await gate.finished(4, kept=0)
    assert (gate.in_flight, gate.buffered) == (0, 0) and gate.try_admit()


async def test_admit_waits_until_room_is_made():
    gate = AdmissionGate(batch_size=4, max_policy_age=0, group_size=2)
    await gate.admit()
    await gate.admit()
    # Record each room check, so that the test knows when the waiter has looked and was refused:
    # it is then blocked until the gate's counts change.
    checks: list[bool] = []
    try_admit = gate.try_admit

    def recorded_try_admit() -> bool:
        checks.append(try_admit())
        return checks[-1]

    gate.try_admit = recorded_try_admit
    waiter = asyncio.ensure_future(gate.admit(timeout=5))
    await wait_until(lambda: checks == [False], "the waiter refused")
    assert not waiter.done()
    await gate.finished(4)
    await wait_until(lambda: checks == [False, False], "the waiter checked again")
    assert not waiter.done()  # finished samples are still ahead of the trainer
    await gate.consumed(4)
    await waiter
    assert checks == [False, False, True]
    assert (gate.in_flight, gate.buffered) == (2, 0)


async def test_admit_deadline_raises_a_clear_error_and_admits_nothing():
    gate = AdmissionGate(batch_size=4, max_policy_age=0, group_size=4)
    await gate.admit()
    message = (
        r"no room for a group of 4 samples within 0.05s: 0 buffered \+ 4 in flight, limit 4 = "
        r"\(max_policy_age 0 \+ 1\) x batch_size 4"
    )
    with pytest.raises(TimeoutError, match=message):
        await gate.admit(timeout=0.05)
    assert gate.in_flight == 4


@pytest.mark.parametrize(
    "batch_size, max_policy_age, group_size", [(8, 0, 3), (8, 0, 16), (4, 1, 10)]
)
def test_sizes_that_could_stall_below_a_batch_are_refused(batch_size, max_policy_age, group_size):
    with pytest.raises(ValueError, match="could stall below a full batch"):
        AdmissionGate(batch_size, max_policy_age, group_size)


def test_sizes_that_always_reach_a_batch_are_accepted():
    AdmissionGate(batch_size=8, max_policy_age=0, group_size=8)
    AdmissionGate(batch_size=8, max_policy_age=1, group_size=3)  # 8 - 1 + 3 <= 16


async def test_counts_that_do_not_add_up_are_refused():
    gate = AdmissionGate(batch_size=4, max_policy_age=0, group_size=2)
    assert gate.try_admit()
    with pytest.raises(ValueError, match=r"finished\(3, kept=3\).*in_flight \(2\)"):
        await gate.finished(3)
    with pytest.raises(ValueError, match=r"finished\(2, kept=3\)"):
        await gate.finished(2, kept=3)
    with pytest.raises(ValueError, match=r"consumed\(1\).*buffered \(0\)"):
        await gate.consumed(1)
    with pytest.raises(ValueError, match=r"started\(-1\)"):
        gate.started(-1)


# --- the invariant, on a simulated rollout loop and training loop -----------------------------


class DrainingGenerator:
    """A generator in `drain` mode: an update waits for running rollouts, and starts none."""

    def __init__(self) -> None:
        self.version = 0
        self._running = 0
        self._draining = False
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def rollout(self) -> AsyncIterator[int]:
        """Runs one rollout; yields the policy version that generates it."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._draining)
            self._running += 1
        try:
            yield self.version
        finally:
            async with self._cond:
                self._running -= 1
                self._cond.notify_all()

    async def update(self, version: int) -> None:
        async with self._cond:
            self._draining = True
            await self._cond.wait_for(lambda: self._running == 0)
            self.version = version
            self._draining = False
            self._cond.notify_all()


async def pause(rng: random.Random, most: int = 12) -> None:
    """A random duration, counted in event-loop turns so that a seed replays it exactly."""
    for _ in range(rng.randrange(most)):
        await asyncio.sleep(0)


async def simulate(
    max_policy_age: int,
    batch_size: int,
    group_size: int,
    seed: int,
    steps: int = 40,
    report_when_taken: bool = False,
) -> tuple[list[int], EpisodeBuffer]:
    """Runs 3 rollout workers and a trainer for `steps` steps; returns every trained age.

    The buffer itself keeps episodes of any age, so that only the gate bounds them.
    """
    rng = random.Random(seed)
    gate = AdmissionGate(batch_size, max_policy_age, group_size)
    cfg = ReplayBufferConfig(capacity=10_000, batch_size=batch_size, max_policy_age=10_000)
    buffer = EpisodeBuffer(cfg)
    generator = DrainingGenerator()
    ages: list[int] = []
    count = 0

    async def rollout_worker() -> None:
        nonlocal count
        while True:
            await gate.admit(timeout=10)
            assert gate.ahead <= gate.limit
            async with generator.rollout() as version:
                await pause(rng)
                if rng.random() < 0.1:  # a filtered-out group, e.g. all rewards equal
                    await gate.finished(group_size, kept=0)
                    continue
                completion = Completion([1], [2], "x", [-1.0], [version], "stop")
                group = [
                    Episode(f"e{count + i}", f"g{count}", completion) for i in range(group_size)
                ]
                buffer.add(group)
                count += group_size
                await gate.finished(group_size)

    async def report_consumed(reported: list[int]) -> None:
        stats = buffer.stats()
        left = stats["retired"] + stats["evicted_stale"] + stats["evicted_capacity"]
        await gate.consumed(left - reported[0])
        reported[0] = left

    async def trainer() -> None:
        reported = [0]
        for version in range(steps):
            while (batch := buffer.sample(version)) is None:
                await pause(rng, most=3)
            ages.extend(version - e.policy_version for rank in batch for e in rank)
            if report_when_taken:
                await report_consumed(reported)
            await pause(rng)  # train
            await generator.update(version + 1)
            if not report_when_taken:
                await report_consumed(reported)

    workers = [asyncio.ensure_future(rollout_worker()) for _ in range(3)]
    try:
        async with asyncio.timeout(30):
            await trainer()
    finally:
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return ages, buffer


@pytest.mark.parametrize(
    "max_policy_age, batch_size, group_size",
    [(0, 8, 4), (0, 4, 4), (1, 8, 4), (1, 6, 3), (2, 8, 2)],
)
@pytest.mark.parametrize("seed", range(3))
async def test_gate_alone_bounds_the_policy_age_of_every_trained_episode(
    max_policy_age, batch_size, group_size, seed
):
    ages, buffer = await simulate(max_policy_age, batch_size, group_size, seed)
    assert len(ages) == 40 * batch_size
    assert max(ages) == max_policy_age  # bounded, and async mode does overlap
    assert buffer.stats()["evicted_stale"] == 0


async def test_reporting_consumption_when_the_batch_is_taken_breaks_the_bound():
    ages, _ = await simulate(0, 8, 4, seed=0, report_when_taken=True)
    assert max(ages) > 0  # sync mode, yet the trainer saw data from an older policy


def test_lowering_the_age_shrinks_the_limit_and_never_raises_it():
    gate = AdmissionGate(batch_size=8, max_policy_age=1, group_size=4)
    assert gate.limit == 16
    gate.lower_max_policy_age(0)  # colocated placement: one batch ahead
    assert gate.limit == 8
    assert gate.try_admit() and gate.try_admit() and not gate.try_admit()
    with pytest.raises(ValueError, match="expected 0 <= A <= 0"):
        gate.lower_max_policy_age(1)
