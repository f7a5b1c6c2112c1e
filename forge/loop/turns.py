"""Turns: generation and training take turns on colocated devices.

Colocated generator and trainer each use every device while they run, so they must never run
at once: generate calls share the devices with each other (`generating`), a training step and
the weight update after it hold them alone (`training`). Training goes first once it asks:
generate calls already running finish, new ones wait until the step is done. Split placement
uses `Turns(enabled=False)`, where both are free for all.
"""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Turns:
    """A readers-writer lock between generate calls (shared) and training (exclusive), the
    writer first."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.generating_now = 0
        self.training_now = False
        self.training_waits = 0
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Held around one generate call; waits while training holds or awaits the devices."""
        if not self.enabled:
            yield
            return
        async with self._changed:
            await self._changed.wait_for(lambda: not self.training_now and not self.training_waits)
            self.generating_now += 1
        try:
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
            yield
        finally:
            async with self._changed:
                self.training_now = False
                self._changed.notify_all()
