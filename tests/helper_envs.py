"""Environments the tests start in EnvironmentActor replicas (importable there: tests/ is on
PYTHONPATH for every process the tests start)."""

import asyncio
from pathlib import Path

from forge.envs.environment import StepResult
from forge.envs.tasks import GuessNumber


class Guess:
    """Guess-a-number from a row {"secret": n}: "higher"/"lower" until right (reward 1).

    `gate`: each step waits until that file exists (so a test can hold every episode mid-step);
    a row with "hang": true never answers its first step.
    """

    def __init__(self, row: dict, gate: str | None = None) -> None:
        self.secret, self.hang, self.gate = row["secret"], row.get("hang", False), gate

    async def reset(self) -> list[dict]:
        return [{"role": "user", "content": "Guess my number, 1 to 100."}]

    async def step(self, text: str) -> StepResult:
        while self.gate and not Path(self.gate).exists():
            await asyncio.sleep(0.05)
        if self.hang:
            await asyncio.Event().wait()
        guess = int(text)
        if guess == self.secret:
            return StepResult(done=True, reward=1.0)
        hint = "higher" if guess < self.secret else "lower"
        return StepResult([{"role": "user", "content": hint}], metrics={"hints": 1})

    async def close(self) -> None:
        pass


class SlowGuess:
    """forge's GuessNumber, each step taking `step_s` seconds (a replica killed mid-run then
    has episodes mid-step), never answering the first step of a row whose index is a multiple
    of `hang_every` (its group times out)."""

    def __init__(self, row: dict, step_s: float, hang_every: int, high: int) -> None:
        self.game = GuessNumber(row, high)
        self.step_s, self.hang = step_s, row["index"] % hang_every == 0

    async def reset(self) -> list[dict]:
        return await self.game.reset()

    async def step(self, text: str) -> StepResult:
        if self.hang:
            await asyncio.Event().wait()
        await asyncio.sleep(self.step_s)
        return await self.game.step(text)

    async def close(self) -> None:
        await self.game.close()
