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
it (and the tasks that task starts while holding it), never waited for.
"""

import asyncio
import contextvars
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal


class _Hold:
    """One acquisition of a turn; `active` until it is released."""

    def __init__(self, turns: "Turns", kind: Literal["generating", "training"]) -> None:
        self.turns, self.kind, self.active = turns, kind, True


# The turns the current task holds (tasks inherit their creator's).
_held: contextvars.ContextVar[tuple[_Hold, ...]] = contextvars.ContextVar(
    "forge_turns_held", default=()
)


class Turns:
    """A readers-writer lock between generate calls (shared) and training (exclusive), the
    writer first, re-entered by its holder."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.generating_now = 0
        self.training_now = False
        self.training_waits = 0
        self._changed = asyncio.Condition()

    def _holding(self, kind: Literal["generating", "training"]) -> bool:
        return any(h.turns is self and h.kind == kind and h.active for h in _held.get())

    @asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Held around generate calls; waits while training holds or awaits the devices."""
        if not self.enabled or self._holding("generating"):
            yield
            return
        async with self._changed:
            await self._changed.wait_for(lambda: not self.training_now and not self.training_waits)
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
        if not self.enabled or self._holding("training"):
            yield
            return
        async with self._changed:
            self.training_waits += 1
            try:
                await self._changed.wait_for(
                    lambda: not self.training_now and not self.generating_now
                )
            finally:
                self.training_waits -= 1
            self.training_now = True
        try:
            async with self._hold("training"):
                yield
        finally:
            async with self._changed:
                self.training_now = False
                self._changed.notify_all()

    @asynccontextmanager
    async def _hold(self, kind: Literal["generating", "training"]) -> AsyncIterator[None]:
        hold, before = _Hold(self, kind), _held.get()
        _held.set((*before, hold))
        try:
            yield
        finally:
            hold.active = False  # tasks started meanwhile hold a copy of `_held`
            _held.set(before)
