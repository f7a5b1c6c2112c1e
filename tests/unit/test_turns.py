"""Turns (forge/loop/turns.py): colocated generation and training never run at once, and
training, once it asks, goes before generate calls that have not started."""

import asyncio

from forge.loop.turns import Turns


def test_training_waits_for_running_generation_and_blocks_new_calls():
    async def scenario():
        turns, log = Turns(enabled=True), []
        first_started, release_first = asyncio.Event(), asyncio.Event()

        async def generate(name, hold=None):
            async with turns.generating():
                log.append(f"{name} start")
                if hold is not None:
                    first_started.set()
                    await hold.wait()
                log.append(f"{name} end")

        async def train():
            async with turns.training():
                log.append("train start")
                await asyncio.sleep(0)
                log.append("train end")

        first = asyncio.ensure_future(generate("g1", release_first))
        await first_started.wait()
        trainer = asyncio.ensure_future(train())
        while not turns.training_waits:  # the trainer has asked
            await asyncio.sleep(0)
        late = asyncio.ensure_future(generate("g2"))
        await asyncio.sleep(0)
        assert log == ["g1 start"]  # neither the trainer nor the late call got in
        release_first.set()
        await asyncio.gather(first, trainer, late)
        return log

    log = asyncio.run(scenario())
    assert log == ["g1 start", "g1 end", "train start", "train end", "g2 start", "g2 end"]


def test_generate_calls_share_their_turn():
    async def scenario():
        turns = Turns(enabled=True)
        inside = []

        async def generate():
            async with turns.generating():
                inside.append(turns.generating_now)
                await asyncio.sleep(0)

        await asyncio.gather(*(generate() for _ in range(3)))
        return inside

    assert max(asyncio.run(scenario())) == 3


def test_disabled_turns_let_both_run_at_once():
    async def scenario():
        turns = Turns(enabled=False)
        async with turns.training():
            async with turns.generating():  # would deadlock if enabled
                return True

    assert asyncio.run(scenario())
