"""Episodes turn by turn (forge.envs.runner) with scripted turns and environments: how each
ends, what its trajectory holds, and that an environment's failure ends only its episode."""

import asyncio

import pytest
from transformers import AutoTokenizer

from forge.data import Completion
from forge.data.chat import ChatBridge
from forge.envs.environment import StepResult
from forge.envs.runner import EpisodeLimits, run_episode
from forge.models import smollm2


@pytest.fixture(scope="module")
def bridge() -> ChatBridge:
    return ChatBridge(AutoTokenizer.from_pretrained(smollm2()))


class Guess:
    """Guess-a-number: "higher"/"lower" until the guess is right; counts its calls."""

    def __init__(self, secret: int, fail: Exception | None = None, hang: bool = False):
        self.secret, self.fail, self.hang = secret, fail, hang
        self.closed = False

    async def reset(self):
        return [{"role": "user", "content": "Guess my number, 1 to 100."}]

    async def step(self, text):
        if self.fail:
            raise self.fail
        if self.hang:
            await asyncio.Event().wait()
        guess = int(text)
        if guess == self.secret:
            return StepResult(done=True, reward=1.0, rewards={"right": 1.0})
        hint = "higher" if guess < self.secret else "lower"
        return StepResult([{"role": "user", "content": hint}], metrics={"hints": 1})

    async def close(self):
        self.closed = True


def scripted(bridge: ChatBridge, guesses: list[str], asked: list[int] | None = None):
    """A sampler answering each turn with the next guess (version = turn number)."""
    tokenizer, turns = bridge.tokenizer, iter(guesses)

    async def sample(context: list[int], max_tokens: int | None) -> Completion:
        if asked is not None:
            asked.append(max_tokens)
        text = next(turns)
        ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        version = len(asked or [])
        return Completion(context, ids, text, [-0.1] * len(ids), [version] * len(ids), "stop")

    return sample


async def test_an_episode_to_its_end_is_one_token_exact_trajectory(bridge):
    env = Guess(42)
    outcome = await run_episode(env, bridge, scripted(bridge, ["50", "25", "42"]), EpisodeLimits())
    assert (outcome.status, outcome.reward, outcome.rewards) == ("done", 1.0, {"right": 1.0})
    assert outcome.metrics == {"hints": 2, "turns": 3} and env.closed
    t = outcome.trajectory
    assert t.texts == ["50", "25", "42"]
    text = bridge.tokenizer.decode(t.context)
    assert text.endswith(
        "50<|im_end|>\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"
        "25<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
        "42<|im_end|>"
    )
    sampled = bridge.tokenizer.decode([i for i, m in zip(t.token_ids, t.mask, strict=True) if m])
    assert sampled == "50<|im_end|>25<|im_end|>42<|im_end|>"


async def test_turn_and_token_limits_end_an_episode_without_a_trailing_observation(bridge):
    outcome = await run_episode(
        Guess(42), bridge, scripted(bridge, ["1", "2", "3"]), EpisodeLimits(max_turns=2)
    )
    assert (outcome.status, outcome.reward, outcome.trajectory.turns) == ("max_turns", 0.0, 2)
    assert outcome.trajectory.mask[-1] == 1  # nothing appended after the last turn
    asked: list[int] = []
    limits = EpisodeLimits(max_turns=9, max_tokens=5)
    outcome = await run_episode(Guess(42), bridge, scripted(bridge, ["1", "2", "3"], asked), limits)
    assert outcome.status == "max_tokens"
    assert asked == [5, 3, 1]  # each turn 2 tokens ("n" and the end of turn): 5, 3, 1 left


async def test_a_turn_gets_the_room_left_in_the_context_and_none_ends_the_episode(bridge):
    two = EpisodeLimits(max_turns=2)
    whole = await run_episode(Guess(42), bridge, scripted(bridge, ["50", "7"]), two)
    lower = whole.trajectory.mask.index(0, 2)  # the first turn, then "lower" in its markup
    context = len(whole.trajectory.prompt_ids) + whole.trajectory.mask.index(1, lower) + 1
    asked: list[int] = []
    play = scripted(bridge, ["50", "7", "9"], asked)
    outcome = await run_episode(Guess(42), bridge, play, EpisodeLimits(max_turns=9), context)
    assert asked == [None, 1]  # the first turn: its own budget; the second: the token left
    assert (outcome.status, outcome.trajectory.turns) == ("max_context", 2)


@pytest.mark.parametrize(
    ("env", "status", "error"),
    [
        (Guess(42, fail=KeyError("no such row")), "error", "KeyError: 'no such row'"),
        (Guess(42, hang=True), "timeout", "no answer within 0.2 s"),
    ],
    ids=["raises", "hangs"],
)
async def test_an_environment_that_raises_or_hangs_ends_its_episode_only(
    bridge, env, status, error
):
    limits = EpisodeLimits(step_timeout_s=0.2)
    outcome = await run_episode(env, bridge, scripted(bridge, ["7"]), limits)
    assert (outcome.status, outcome.reward, outcome.error) == (status, 0.0, error)
    assert outcome.metrics[f"{status}s" if status == "timeout" else "errors"] == 1
    assert outcome.trajectory.turns == 1 and env.closed


async def test_a_sampler_failure_is_not_the_environment_s_and_is_raised(bridge):
    async def dead(context, max_tokens):
        raise RuntimeError("generator replica died")

    env = Guess(42)
    with pytest.raises(RuntimeError, match="generator replica died"):
        await run_episode(env, bridge, dead, EpisodeLimits())
    assert env.closed


async def test_step_rewards_add_up_and_a_truncated_episode_keeps_them(bridge):
    class Dense(Guess):
        async def step(self, text):
            result = await super().step(text)
            result.reward += 0.25
            result.rewards = {"step": 0.25}
            return result

    outcome = await run_episode(
        Dense(42), bridge, scripted(bridge, ["1", "2", "3"]), EpisodeLimits(max_turns=3)
    )
    assert (outcome.status, outcome.reward, outcome.rewards) == ("max_turns", 0.75, {"step": 0.75})
    failed = await run_episode(
        Dense(42, fail=KeyError("x")), bridge, scripted(bridge, ["1"]), EpisodeLimits()
    )
    assert (failed.status, failed.reward, failed.rewards) == ("error", 0.0, {})


async def test_an_answer_that_does_not_render_and_a_close_that_fails_are_the_environment_s(bridge):
    class Silent(Guess):
        async def step(self, text):
            return StepResult()  # neither done nor saying anything

        async def close(self):
            raise OSError("already closed")

    outcome = await run_episode(Silent(42), bridge, scripted(bridge, ["1"]), EpisodeLimits())
    assert outcome.status == "error"
    assert outcome.error.startswith("its answer does not render: a turn is followed by")


async def test_a_timeout_the_environment_raises_itself_is_its_error_not_the_step_limit(bridge):
    class Slow(Guess):
        async def step(self, text):
            raise TimeoutError("reward took too long")

    outcome = await run_episode(Slow(42), bridge, scripted(bridge, ["1"]), EpisodeLimits())
    assert (outcome.status, outcome.error) == ("error", "TimeoutError: reward took too long")
