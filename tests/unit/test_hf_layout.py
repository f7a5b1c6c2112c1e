"""HfLayout gives what torchtitan's `to_hf` gives, into buffers it reuses, or declines."""

import pytest
import torch

from forge.models import tiny_model
from forge.models.hf_layout import HfLayout
from forge.models.titan import load_pretrained, titan_model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_same_tensors_as_to_hf_and_the_reordered_ones_in_reused_buffers(family):
    """torchtitan's Llama keeps q and k in its own rotary layout (reordered for HF); its Qwen3
    keeps HF's (nothing reordered)."""
    path = tiny_model(family, seed=0, heads=4, kv_heads=2)
    adapter = titan_model(path).adapter
    state_dict = load_pretrained(path).state_dict()
    layout = HfLayout.learn(adapter, state_dict)
    assert layout is not None
    expected, got = adapter.to_hf(state_dict), layout(state_dict)
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    reordered = [k for k in got if got[k].data_ptr() != state_dict_ptr(state_dict, got[k])]
    assert sorted({k.split(".")[-2] for k in reordered}) == (
        ["k_proj", "q_proj"] if family == "llama" else []
    )
    with torch.no_grad():
        for tensor in state_dict.values():
            tensor.add_(1.0)  # the next step's weights
    again = layout(state_dict)
    assert all(again[k].data_ptr() == got[k].data_ptr() for k in got)
    assert all(torch.equal(again[k], adapter.to_hf(state_dict)[k]) for k in again)


def state_dict_ptr(state_dict: dict[str, torch.Tensor], tensor: torch.Tensor) -> int:
    """The data pointer of the input tensor `tensor` aliases, or -1."""
    ptrs = {t.data_ptr() for t in state_dict.values()}
    return tensor.data_ptr() if tensor.data_ptr() in ptrs else -1


class _Scaling:
    def to_hf(self, state_dict):
        return {k: v * 2 for k, v in state_dict.items()}


class _Columns:
    def to_hf(self, state_dict):
        return {k: v.flip(-1) for k, v in state_dict.items()}


class _Fusing:
    def to_hf(self, state_dict):
        return {"fused": torch.cat(list(state_dict.values()))}


@pytest.mark.parametrize(
    "adapter", [_Scaling(), _Columns(), _Fusing()], ids=lambda a: type(a).__name__
)
def test_a_to_hf_that_does_more_than_rename_and_reorder_rows_is_not_learned(adapter):
    state_dict = {"a": torch.randn(4, 3), "b": torch.randn(4, 3)}
    assert HfLayout.learn(adapter, state_dict) is None
