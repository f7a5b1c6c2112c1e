"""Admission gate: the rollout loop starts a rollout group only if off-policy data stays bounded.

With train batch size B (episodes per step) and `max_policy_age` A, at most L = (A + 1) * B
samples may be *ahead* of the trainer: in flight (admitted, not yet in the buffer) or buffered
(in the buffer, not yet consumed). A group of G samples starts only if

    buffered + in_flight + G <= (A + 1) * B

so `ahead <= L` holds at all times. `max_policy_age: 0` (sync mode) allows exactly one batch.

    gate = AdmissionGate(batch_size=B, max_policy_age=A, group_size=G)
    # rollout loop, per group:
    await gate.admit(timeout=60)                  # the group now counts as in flight
    try:
        episodes = await rollout(prompt)
        await buffer.add.call_one(episodes)
    except BaseException:
        await gate.finished(G, kept=0)
        raise
    await gate.finished(G)
    # training loop, per step v:
    batch = await buffer.sample.call_one(curr_policy_version=v)
    ...train; push weights v + 1; await generator.update_weights.fanout(v + 1)...
    await gate.consumed(n)  # n: growth of retired + evicted_* in the buffer's stats

Why this bounds policy age. Report `consumed` only once the weights trained on those samples
are on every generator (or every generator was asked to load them: a generator holds a request
made while it updates until the update is over), and let every rollout admitted before a weight
update be in the buffer before that update completes (the generator's `drain` mode does this for
generation; scoring must be quick, or drained too). Take a group admitted when k batches have
been reported consumed: the generators are at version >= k, so its policy version is >= k. No
consumption is reported while it is in flight, so it and every sample that enters the buffer
before it were admitted while at most k * B had been reported consumed: all are among the first
k * B + L = (k + A + 1) * B samples admitted. FIFO sampling with `max_reuse: 1` takes samples
in buffer order, B per step, so the group is trained by version k + A at the latest: its age is
<= A, and the buffer never drops stale data. Where a rollout can outlive updates
(`abort`/`inflight` modes, slow scoring), or sampling is random or reuses episodes, the buffer's
`max_policy_age` check drops what slips through, and counts it.
"""

import asyncio
import math


class AdmissionGate:
    """Counts samples ahead of the trainer and admits a rollout group only if it fits.

    The counts change only through this object, from one event loop: the rollout loop and the
    training loop run as tasks of the same loop.

    Args:
        batch_size: B, episodes the trainer consumes per step.
        max_policy_age: A, as in the replay buffer's config.
        group_size: G, samples per rollout group (GRPO's group).
    """

    def __init__(self, batch_size: int, max_policy_age: int, group_size: int) -> None:
        if batch_size < 1 or group_size < 1 or max_policy_age < 0:
            raise ValueError(
                "need batch_size >= 1, group_size >= 1 and max_policy_age >= 0, got "
                f"{batch_size}, {group_size} and {max_policy_age}"
            )
        self._batch_size = batch_size
        self._max_policy_age = max_policy_age
        self._group_size = group_size
        self._check_progress()
        self._in_flight = 0
        self._buffered = 0
        self._cond = asyncio.Condition()

    def _check_progress(self) -> None:
        """Refuses sizes with which the trainer could wait forever for a batch.

        Whole groups come in and whole batches go out, so `ahead` is a multiple of
        d = gcd(G, B). When nothing is in flight and fewer than B samples are buffered,
        `ahead` <= B - d, and one more group must fit: B - d + G <= L.
        """
        b, g = self._batch_size, self._group_size
        if b - math.gcd(g, b) + g > self.limit:
            raise ValueError(
                f"group_size {g} does not fit batch_size {b} with max_policy_age "
                f"{self._max_policy_age}: the gate could stall below a full batch (with "
                "max_policy_age 0, group_size must divide batch_size)"
            )

    @property
    def batch_size(self) -> int:
        """B: episodes consumed per training step."""
        return self._batch_size

    @property
    def max_policy_age(self) -> int:
        """A: how many versions the trainer may be ahead of the data it trains on."""
        return self._max_policy_age

    @property
    def group_size(self) -> int:
        """G: samples admitted per rollout group."""
        return self._group_size

    @property
    def limit(self) -> int:
        """L = (A + 1) * B: the most samples ever ahead of the trainer."""
        return (self._max_policy_age + 1) * self._batch_size

    @property
    def in_flight(self) -> int:
        """Samples admitted whose rollouts have not finished."""
        return self._in_flight

    @property
    def buffered(self) -> int:
        """Samples in the buffer not yet reported consumed."""
        return self._buffered

    @property
    def ahead(self) -> int:
        """buffered + in_flight; never more than `limit`."""
        return self._buffered + self._in_flight

    def try_admit(self) -> bool:
        """Admits one group now if it fits (and counts it in flight); False if it does not."""
        if self.ahead + self._group_size > self.limit:
            return False
        self.started(self._group_size)
        return True

    async def admit(self, timeout: float | None = None) -> None:
        """Waits until one group fits, then admits it (counts it in flight).

        Raises:
            TimeoutError: no room within `timeout` seconds.
        """
        try:
            async with asyncio.timeout(timeout), self._cond:
                await self._cond.wait_for(self.try_admit)
        except TimeoutError:
            raise TimeoutError(
                f"admission gate: no room for a group of {self._group_size} samples within "
                f"{timeout}s: {self._buffered} buffered + {self._in_flight} in flight, limit "
                f"{self.limit} = (max_policy_age {self._max_policy_age} + 1) x batch_size "
                f"{self._batch_size}; is the training loop reporting consumed()?"
            ) from None

    def restore(self, buffered: int) -> None:
        """Counts `buffered` samples already in the buffer, as after resuming a run: a fresh
        gate holding them, none in flight."""
        if self.ahead:
            raise ValueError(f"restore({buffered}): the gate already counts {self.ahead} samples")
        if buffered < 0:
            raise ValueError(f"restore({buffered}): expected buffered >= 0")
        self._buffered = buffered

    def lower_max_policy_age(self, max_policy_age: int) -> None:
        """Lowers A (never raises it) before rollouts start; samples already counted stay, and
        new groups wait until they fit under the lower limit."""
        if not 0 <= max_policy_age <= self._max_policy_age:
            raise ValueError(
                f"lower_max_policy_age({max_policy_age}): expected 0 <= A <= {self._max_policy_age}"
            )
        self._max_policy_age = max_policy_age
        self._check_progress()

    async def set_max_policy_age(self, max_policy_age: int) -> None:
        """Changes A while rollouts run: samples already counted stay; a lower limit holds new
        groups back until they fit, a higher one admits the groups waiting for room."""
        previous, self._max_policy_age = self._max_policy_age, max_policy_age
        try:
            self._check_progress()
        except ValueError:
            self._max_policy_age = previous
            raise
        async with self._cond:
            self._cond.notify_all()

    def started(self, n: int) -> None:
        """Counts `n` more samples in flight. `admit`/`try_admit` do it for their group; call
        it only for samples started without them."""
        if n < 0:
            raise ValueError(f"started({n}): expected n >= 0")
        self._in_flight += n

    async def finished(self, n: int, kept: int | None = None) -> None:
        """`n` in-flight samples are done; `kept` of them (default all) went into the buffer.

        Call it as soon as the episodes are in the buffer, since the trainer may report them
        consumed from then on. A failed or filtered-out group keeps 0; keep whole groups, or
        none, so that `ahead` stays a multiple of gcd(G, B) and a full batch can always be
        reached.
        """
        kept = n if kept is None else kept
        async with self._cond:
            if not 0 <= kept <= n <= self._in_flight:
                raise ValueError(
                    f"finished({n}, kept={kept}): expected 0 <= kept <= n <= in_flight "
                    f"({self._in_flight})"
                )
            self._in_flight -= n
            self._buffered += kept
            self._cond.notify_all()

    async def consumed(self, n: int) -> None:
        """`n` buffered samples left the buffer: trained on for the last time, or evicted.

        Report a training step's samples once its new weights are on every generator, not
        when the trainer takes the batch: samples admitted in between would still be made by
        the old weights (see the module docstring).
        """
        async with self._cond:
            if not 0 <= n <= self._buffered:
                raise ValueError(f"consumed({n}): expected 0 <= n <= buffered ({self._buffered})")
            self._buffered -= n
            self._cond.notify_all()
