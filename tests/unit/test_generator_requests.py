"""The generator's request layer and engine statistics, without an engine: vLLM's own output
and stats types, SmolLM2's real tokenizer."""

import asyncio
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, WeightVersionSpan
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from forge.actors.generator import GeneratorConfig, SamplingConfig
from forge.actors.generator.requests import Requests, Sample
from forge.actors.vllm.engine_stats import EngineStats
from forge.models import smollm2


def output(tokens, logprobs, spans, finish=None) -> CompletionOutput:
    return CompletionOutput(
        index=0,
        text="",
        token_ids=tokens,
        cumulative_logprob=None,
        logprobs=[{t: Logprob(lp)} for t, lp in zip(tokens, logprobs, strict=True)],
        finish_reason=finish,
        weight_versions=[WeightVersionSpan(str(v), a, b) for v, a, b in spans],
    )


@pytest.fixture(scope="module")
def requests() -> Requests:
    tokenizer = AutoTokenizer.from_pretrained(smollm2())
    cfg = GeneratorConfig(max_model_len=64, sampling=SamplingConfig(max_tokens=16))
    return Requests(None, tokenizer, cfg, aborting_swaps=lambda: 0)


def test_a_sequence_cut_by_a_swap_and_continued_keeps_each_tokens_version():
    first = Sample.of(output([5, 6, 7], [-0.1, -0.2, -0.3], [(3, 0, 2), (4, 2, 3)]))
    assert first.stop_reason == "abort"  # no finish reason: the engine aborted it
    rest = Sample.of(output([8, 9], [-0.4, -0.5], [(4, 0, 2)], finish="length"))
    whole = first.extend(rest)
    assert whole.token_ids == [5, 6, 7, 8, 9]
    assert whole.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert whole.versions == [3, 3, 4, 4, 4]
    assert whole.stop_reason == "length"


def test_prompts_of_every_kind_become_token_ids(requests):
    text = requests.prompt_ids("What is 2+3?")
    assert text == requests.tokenizer.encode("What is 2+3?")
    chat = requests.prompt_ids([{"role": "user", "content": "What is 2+3?"}])
    assert len(chat) > len(text) and set(text) <= set(chat)  # the chat template wraps it
    assert requests.prompt_ids([1, 2, 3]) == [1, 2, 3]
    for bad, message in [("  ", "empty prompt"), ([1, "a"], "prompt must be text")]:
        with pytest.raises(ValueError, match=message):
            requests.prompt_ids(bad)


def test_sampling_overrides_apply_and_bad_ones_name_the_cause(requests):
    params = requests.sampling_params(4, {"temperature": 0.5}, prompt_len=10)
    assert (params.n, params.temperature, params.max_tokens, params.logprobs) == (4, 0.5, 16, 0)
    with pytest.raises(ValueError, match=r"unknown sampling parameters \['temp'\]"):
        requests.sampling_params(None, {"temp": 0.5}, prompt_len=10)
    with pytest.raises(ValueError, match="prompt of 60 tokens leaves 4"):
        requests.sampling_params(None, None, prompt_len=60)
    with pytest.raises(ValueError, match="bad sampling parameters"):
        requests.sampling_params(None, {"top_p": 2.0}, prompt_len=10)


def test_engine_stats_count_tokens_between_snapshots_and_time_engine_steps():
    stats = EngineStats()
    assert stats.snapshot()["step_s"] == stats.snapshot()["last_step_s"] == 0.0
    for when in [100.0, 100.2, 100.3, 100.5, 103.0]:  # the last interval: a pause, say
        step = IterationStats()
        step.num_generation_tokens = 7
        step.iteration_timestamp = when
        stats.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2), step)
    stats.record(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25), None)
    snap = stats.snapshot()
    assert (snap["tokens_total"], snap["running"], snap["waiting"]) == (35, 1, 0)
    assert snap["kv_cache_usage"] == 0.25 and snap["tokens_per_s"] > 0
    assert snap["step_s"] == pytest.approx(0.2)  # the median: one long interval moves it not
    assert snap["last_step_s"] == pytest.approx(2.5)
    assert stats.snapshot()["tokens_total"] == 35


class _Engine:
    """Answers each request with the next of `outputs`, and counts the requests."""

    def __init__(self, *outputs: CompletionOutput) -> None:
        self.outputs = list(outputs)
        self.requests = 0

    async def generate(self, request, params, request_id, lora_request=None):
        self.requests += 1
        yield SimpleNamespace(outputs=[self.outputs.pop(0)])


@pytest.mark.parametrize("swap_under_way", [True, False])
async def test_a_request_aborted_while_a_swap_is_under_way_is_continued(swap_under_way):
    """The swap counted itself before this request started, so the count did not move while it
    ran: the swap being under way is what says the abort was the swap's."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2())
    cfg = GeneratorConfig(max_model_len=64, sampling=SamplingConfig(max_tokens=4))
    aborted = output([], [], [])  # cut before its first token
    finished = output([5, 6], [-0.1, -0.2], [(1, 0, 2)], finish="stop")
    engine = _Engine(aborted, finished)
    requests = Requests(
        engine, tokenizer, cfg, aborting_swaps=lambda: 1, aborting=lambda: swap_under_way
    )
    (completion,) = await requests.generate([1, 2, 3], n=1)
    if swap_under_way:
        assert engine.requests == 2 and completion.token_ids == [5, 6]
    else:  # an abort that no swap made (a cancelled call) ends the request
        assert engine.requests == 1 and completion.token_ids == []


async def test_a_request_waits_for_an_update_under_way_before_it_enters_the_engine():
    """A request made once an update was asked for must generate on that update's version."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2())
    cfg = GeneratorConfig(max_model_len=64, sampling=SamplingConfig(max_tokens=4))
    engine = _Engine(output([5, 6], [-0.1, -0.2], [(2, 0, 2)], finish="stop"))
    settled = asyncio.Event()
    requests = Requests(engine, tokenizer, cfg, aborting_swaps=lambda: 0, settled=settled.wait)
    call = asyncio.ensure_future(requests.generate([1, 2, 3], n=1))
    for _ in range(10):  # every chance to run, short of the update being over
        await asyncio.sleep(0)
    assert engine.requests == 0 and not call.done()
    settled.set()
    (completion,) = await call
    assert engine.requests == 1 and completion.token_versions == [2, 2]
