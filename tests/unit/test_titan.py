"""torchtitan models built from HF checkpoints compute what transformers computes."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from forge.models import smollm2, tiny_model
from forge.models.titan import hf_state_dict, load_pretrained, titan_model, token_logprobs


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
