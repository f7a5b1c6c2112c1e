"""Turns: generation and training take turns on colocated devices.

Colocated generator and trainer each use every device while they run, so they must never run
at once: generate calls share the devices with each other (`generating`), a training step and
the weight update after it hold them alone (`training`). Training goes first once it asks:
generate calls already running finish, new ones wait until the step is done. Split placement
uses `Turns(enabled=False)`, where both are free for all.

The handles the loop calls generator and trainer through take the turn in every call that
computes on the devices, so no caller can forget it; a caller that needs one turn to span
several calls (a training step and its weight update, a rollout and its scoring) holds it
around them, and the calls inside find it held: a turn is re-entered by the task that holds
it (and the tasks that task starts while holding it), never waited for. Each re-entry counts
as a holder until it ends, so a started task still inside a call when its creator lets go
keeps the other side waiting. A task that holds one kind and asks for the other would wait for
itself: it fails at once instead (a task it starts waits for its turn like any other).
"""

import asyncio
import contextvars
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

Kind = Literal["generating", "training"]


class _Hold:
    """One acquisition of a turn by `task`; `active` until it is released."""

    def __init__(self, turns: "Turns", kind: Kind) -> None:
        self.turns, self.kind, self.active = turns, kind, True
        self.task = asyncio.current_task()


# The turns the current task holds (tasks inherit their creator's).
_held: contextvars.ContextVar[tuple[_Hold, ...]] = contextvars.ContextVar(
    "forge_turns_held", default=()
)


class Turns:
    """A readers-writer lock between generate calls (shared) and training (exclusive), the
    writer first, re-entered by its holder."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.generating_now = 0  # generate holds, re-entries included
        self.training_now = 0  # the training hold and its re-entries
        self.training_waits = 0
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Held around generate calls; waits while training holds or awaits the devices."""
        if not self.enabled:
            yield
            return
        reentry = self._check("generating")
        async with self._changed:
            if not reentry:
                await self._changed.wait_for(
                    lambda: not self.training_now and not self.training_waits
                )
            self.generating_now += 1
        try:
            async with self._hold("generating"):
                yield
        finally:
            async with self._changed:
                self.generating_now -= 1
                self._changed.notify_all()

    @asynccontextmanager
    async def training(self) -> AsyncIterator[None]:
        """Held around a training step and its weight update: running generate calls finish
        first, and none starts until the block ends."""
        if not self.enabled:
            yield
            return
        reentry = self._check("training")
        async with self._changed:
            if not reentry:
                self.training_waits += 1
                try:
                    await self._changed.wait_for(
                        lambda: not self.training_now and not self.generating_now
                    )
                finally:
                    self.training_waits -= 1
                    self._changed.notify_all()  # a cancelled wait lets generation go again
            self.training_now += 1
        try:
            async with self._hold("training"):
                yield
        finally:
            async with self._changed:
                self.training_now -= 1
                self._changed.notify_all()

    def _check(self, kind: Kind) -> bool:
        """Whether this task re-enters a `kind` turn it (or its creator) holds; raises if
        this very task holds the other kind, which it would wait for forever."""
        holds = [h for h in _held.get() if h.turns is self and h.active]
        if any(h.kind != kind and h.task is asyncio.current_task() for h in holds):
            other = "generating" if kind == "training" else "training"
            raise RuntimeError(
                f"colocated turns: a task holding the {other} turn asked for the {kind} turn, "
                "which waits until the first ends; call it outside that turn"
            )
        return any(h.kind == kind for h in holds)

    @asynccontextmanager
    async def _hold(self, kind: Kind) -> AsyncIterator[None]:
        hold, before = _Hold(self, kind), _held.get()
        _held.set((*before, hold))
        try:
            yield
        finally:
            hold.active = False  # tasks started meanwhile hold a copy of `_held`
            _held.set(before)
