"""Turns (forge/placement/turns.py): colocated generation and training never run at once, and
training, once it asks, goes before generate calls that have not started."""

import asyncio

from forge.placement.turns import Turns


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


def test_the_holder_reenters_its_turn_while_the_other_side_waits():
    async def scenario():
        turns, log = Turns(enabled=True), []
        asked = asyncio.Event()

        async def train():
            asked.set()
            async with turns.training():
                log.append("train")

        async with turns.generating():  # a rollout's span: its generate call and scoring
            trainer = asyncio.ensure_future(train())
            await asked.wait()
            while not turns.training_waits:
                await asyncio.sleep(0)
            async with turns.generating():  # the generate call inside: no wait, no deadlock
                log.append("generate")
            assert turns.generating_now == 1
        await trainer
        async with turns.training():  # a step's span: its train_step and weight update
            async with turns.training():
                log.append("update")
        return log

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == ["generate", "train", "update"]


def test_a_task_started_in_a_turn_holds_it_no_longer_once_it_ended():
    async def scenario():
        turns = Turns(enabled=True)
        go, generating, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def train_later():
            await go.wait()
            async with turns.training():
                assert not turns.generating_now

        async def generate():
            async with turns.generating():
                generating.set()
                await release.wait()

        async with turns.training():
            # Started inside the training turn (an eval the weight update starts): its
            # generate calls are not part of the turn and wait until training ends.
            late = asyncio.ensure_future(_generate(turns))
            child = asyncio.ensure_future(train_later())
            await asyncio.sleep(0)
            assert not late.done()
        await late
        generator = asyncio.ensure_future(generate())
        await generating.wait()
        go.set()  # the child's copy of the ended training turn does not let it in
        while not turns.training_waits:
            await asyncio.sleep(0)
        assert not child.done()
        release.set()
        await asyncio.gather(generator, child)
        return True

    assert asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_task_asking_for_the_other_turn_than_it_holds_fails_at_once():
    async def scenario():
        turns, errors = Turns(enabled=True), []
        for outer, inner in (("generating", "training"), ("training", "generating")):
            async with getattr(turns, outer)():
                try:
                    async with getattr(turns, inner)():
                        pass
                except RuntimeError as e:
                    errors.append(str(e))
        async with turns.training():  # neither turn was left held or awaited
            pass
        return errors

    errors = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert len(errors) == 2
    assert "holding the generating turn asked for the training turn" in errors[0]
    assert "holding the training turn asked for the generating turn" in errors[1]


def test_a_started_task_still_in_its_call_keeps_training_waiting_after_its_creator_let_go():
    async def scenario():
        turns, log = Turns(enabled=True), []
        inside, release = asyncio.Event(), asyncio.Event()

        async def score():  # started by a rollout, re-entering the rollout's turn
            async with turns.generating():
                inside.set()
                await release.wait()
                log.append("score end")

        async def train():
            async with turns.training():
                log.append("train")

        async with turns.generating():
            child = asyncio.ensure_future(score())
            await inside.wait()
        trainer = asyncio.ensure_future(train())
        while not turns.training_waits:
            await asyncio.sleep(0)
        assert not trainer.done()
        release.set()
        await asyncio.gather(child, trainer)
        return log

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == ["score end", "train"]


async def _generate(turns: Turns) -> None:
    async with turns.generating():
        assert not turns.training_now


# --- the handles take the turns ---------------------------------------------------------------


class _Endpoint:
    """An endpoint whose calls log when they start and end, and wait for `release`."""

    def __init__(self, name: str, log: list[str], release: asyncio.Event) -> None:
        self.name, self.log, self.release = name, log, release

    async def _run(self, *args, **kwargs):
        self.log.append(f"{self.name} start")
        await self.release.wait()
        self.log.append(f"{self.name} end")
        return {"rank0": {}}

    def call(self, *args, **kwargs):
        return self._run()

    async def route(self, *args, **kwargs):
        return (await self._run())["rank0"]


def test_the_handles_take_the_turns_so_no_caller_can_forget_them():
    from types import SimpleNamespace

    from forge.loop.generator_handle import GeneratorHandle
    from forge.loop.trainer_handle import TrainerHandle

    async def scenario():
        turns, log, release = Turns(enabled=True), [], asyncio.Event()
        trainer = TrainerHandle(SimpleNamespace(train_step=_Endpoint("train", log, release)), turns)
        generator = GeneratorHandle(
            SimpleNamespace(generate=_Endpoint("generate", log, release)), turns
        )
        generating = asyncio.ensure_future(generator.generate("prompt", n=1))
        while not turns.generating_now:
            await asyncio.sleep(0)
        training = asyncio.ensure_future(trainer.train_step([[]]))  # no turn taken here
        while not turns.training_waits:
            await asyncio.sleep(0)
        assert log == ["generate start"]  # the step waits for the running generate call
        release.set()
        await asyncio.gather(generating, training)
        return log

    log = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert log == ["generate start", "generate end", "train start", "train end"]
