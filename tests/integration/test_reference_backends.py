"""ReferenceModel's two backends, torchtitan and vLLM prompt logprobs, in real Monarch processes.

Both score the same tiny model (init std 0.5: peaked distributions, logprobs far from 0 for
random tokens, so a position shifted by one would show) and must agree token by token.
"""

import pytest
import torch
from monarch.actor import ActorError

from forge.actors.reference import ReferenceConfig, ReferenceModel
from forge.controller import shutdown
from forge.models import tiny_model

pytestmark = pytest.mark.integration

TOLERANCE = 1e-3
# (prompt length, completion length): one-token and long completions, short and long prompts.
SHAPES = [(1, 1), (3, 7), (12, 1), (25, 40), (7, 130), (150, 20)]


@pytest.fixture(scope="module")
async def backends():
    model = str(tiny_model("llama", seed=0, init_std=0.5))
    options = ReferenceModel.options(env={"OMP_NUM_THREADS": "1"})
    titan = await options.as_actor(ReferenceConfig(model=model, max_batch=4))
    vllm = await options.as_actor(
        ReferenceConfig(model=model, backend="vllm", max_model_len=256, kv_cache_mb=64)
    )
    yield titan, vllm
    await shutdown()


def random_pairs() -> list[tuple[list[int], list[int]]]:
    generator = torch.Generator().manual_seed(0)
    pairs = []
    for prompt_len, completion_len in SHAPES:
        ids = torch.randint(0, 49152, (prompt_len + completion_len,), generator=generator)
        pairs.append((ids[:prompt_len].tolist(), ids[prompt_len:].tolist()))
    return pairs


async def test_backends_give_the_same_token_logprobs(backends):
    titan, vllm = backends
    pairs = random_pairs()
    expected = await titan.logprobs.call_one(pairs)
    got = await vllm.logprobs.call_one(pairs)
    worst = 0.0
    for (_, completion), a, b in zip(pairs, expected, got, strict=True):
        assert len(a) == len(b) == len(completion)
        worst = max(worst, (torch.tensor(a) - torch.tensor(b)).abs().max().item())
    print(f"max |titan - vllm| logprob difference: {worst:.2e}")
    assert worst < TOLERANCE
    # The check has teeth: these are not all near 0 (a shifted position would be far off).
    assert min(min(a) for a in expected) < -5


async def test_backends_give_the_same_top_k_tokens_and_logprobs(backends):
    """The teacher's top k per position (distillation with teacher_top_k): same tokens, same
    logprobs, most likely first, and the actual token's logprob as `logprobs` gives it."""
    titan, vllm = backends
    pairs, k = random_pairs(), 5
    expected = await titan.top_logprobs.call_one(pairs, k)
    got = await vllm.top_logprobs.call_one(pairs, k)
    plain = await titan.logprobs.call_one(pairs)
    for (_, completion), a, b, lp in zip(pairs, expected, got, plain, strict=True):
        assert len(a.top_ids) == len(b.top_ids) == len(completion)
        assert all(len(ids) == k for ids in b.top_ids)
        assert a.top_ids == b.top_ids
        top_a, top_b = torch.tensor(a.top_logprobs), torch.tensor(b.top_logprobs)
        assert (top_a - top_b).abs().max().item() < TOLERANCE
        assert (top_b[:, :-1] >= top_b[:, 1:]).all()
        assert (torch.tensor(b.logprobs) - torch.tensor(lp)).abs().max().item() < TOLERANCE
        # One backend, two paths: equal up to float32 rounding of logprobs near -40.
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(lp), rtol=1e-6, atol=1e-5)


async def test_vllm_backend_refuses_a_pair_too_long_and_stays_usable(backends):
    _, vllm = backends
    with pytest.raises(ActorError, match="max_model_len"):
        await vllm.logprobs.call_one([([1] * 200, [2] * 100)])
    assert len((await vllm.logprobs.call_one([([1, 2, 3], [4, 5])]))[0]) == 2


def test_vllm_backend_refuses_a_temperature_other_than_1():
    with pytest.raises(ValueError, match="temperature"):
        ReferenceConfig(backend="vllm", temperature=0.7)
    with pytest.raises(ValueError, match="backend"):
        ReferenceConfig(backend="hf")
