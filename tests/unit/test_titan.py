"""torchtitan models built from HF checkpoints compute what transformers computes."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from forge.models import smollm2, tiny_model
from forge.models.titan import (
    candidate_logprobs,
    hf_state_dict,
    load_pretrained,
    titan_model,
    token_logprobs,
    top_logprobs,
)


def hf_logprobs(path, input_ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids).logits[:, :-1]
    return logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "path",
    [lambda: smollm2(), lambda: tiny_model("qwen3", seed=0), lambda: tiny_model("llama", seed=2)],
    ids=["smollm2", "tiny-qwen3", "tiny-llama"],
)
def test_titan_logprobs_equal_transformers(path):
    path = path()
    input_ids = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = token_logprobs(load_pretrained(path), input_ids)
    diff = (ours - hf_logprobs(path, input_ids)).abs().max().item()
    print(f"{path.name}: max abs logprob diff torchtitan vs transformers {diff:.2e}")
    assert diff < 1e-4


def test_hf_names_round_trip_and_tied_head_stays_out():
    path = smollm2()
    model = titan_model(path)
    hf = hf_state_dict(path)
    titan = model.adapter.from_hf(dict(hf))  # from_hf adds the tied head to its input
    assert titan["lm_head.weight"] is titan["tok_embeddings.weight"] or torch.equal(
        titan["lm_head.weight"], titan["tok_embeddings.weight"]
    )
    back = model.adapter.to_hf(titan)
    assert set(back) == set(hf) and "lm_head.weight" not in back
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        titan_model(tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logits_in_chunks_give_the_same_logprobs_and_gradients(family):
    model = load_pretrained(tiny_model(family, seed=1)).train()
    ids = torch.randint(0, 1000, (3, 11), generator=torch.Generator().manual_seed(0))
    candidates = torch.randint(0, 1000, (3, 10, 4), generator=torch.Generator().manual_seed(1))
    results = []
    for chunk_tokens in (10_000, 4):  # the whole batch at once, then 1 position per chunk
        model.zero_grad()
        actual, chosen = candidate_logprobs(model, ids, candidates, 0.7, chunk_tokens)
        (actual.sum() + chosen.exp().sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        plain = token_logprobs(model, ids, 0.7, chunk_tokens)
        top = top_logprobs(model, ids, 5, 0.7, chunk_tokens)
        results.append((actual.detach(), chosen.detach(), grads, plain.detach(), top))
    (a1, c1, g1, p1, t1), (a2, c2, g2, p2, t2) = results
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(c1, c2)
    torch.testing.assert_close(p1, a1)
    for whole, chunked in zip(g1, g2, strict=True):  # sums in another order: float noise only
        scale = float(whole.abs().max())
        assert (whole - chunked).abs().max() <= 1e-4 * scale, (whole - chunked).abs().max() / scale
    for whole, chunked in zip(t1, t2, strict=True):
        torch.testing.assert_close(whole, chunked)
    assert max(g.abs().max() for g in g1) > 0


@pytest.mark.parametrize("chunk_tokens", [10_000, 4], ids=["one chunk", "many chunks"])
def test_positions_before_first_get_no_logits_and_the_rest_are_unchanged(chunk_tokens):
    model = load_pretrained(tiny_model("llama", seed=1)).train()
    ids = torch.randint(0, 1000, (3, 11), generator=torch.Generator().manual_seed(0))
    candidates = torch.randint(0, 1000, (3, 10, 4), generator=torch.Generator().manual_seed(1))
    results = []
    for first in (0, 6):
        model.zero_grad()
        actual, chosen = candidate_logprobs(model, ids, candidates, 0.7, chunk_tokens, first)
        (actual[:, 6:].sum() + chosen[:, 6:].exp().sum()).backward()
        plain = token_logprobs(model, ids, 0.7, chunk_tokens, first)
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((actual.detach(), chosen.detach(), plain.detach(), grads))
    (a0, c0, p0, g0), (a6, c6, p6, g6) = results
    assert a6.shape == a0.shape and c6.shape == c0.shape and p6.shape == p0.shape
    assert not a6[:, :6].any() and not c6[:, :6].any() and not p6[:, :6].any()
    assert a0[:, :6].abs().min() > 0  # the full pass does compute them
    torch.testing.assert_close(a6[:, 6:], a0[:, 6:])
    torch.testing.assert_close(c6[:, 6:], c0[:, 6:])
    torch.testing.assert_close(p6[:, 6:], p0[:, 6:])
    for full, skipped in zip(g0, g6, strict=True):
        torch.testing.assert_close(skipped, full, rtol=1e-4, atol=1e-4 * float(full.abs().max()))
