"""prune_layers: a layer-pruned checkpoint that transformers loads, with the right layers."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge.models import tiny_model
from forge.models.prune import PrunedModel, prune_layers


@pytest.fixture(scope="module")
def source():
    # Distinct random layers (seeded), so a layer renumbered wrongly shows in the tensors.
    return tiny_model("llama", layers=4, hidden=64, intermediate=128, heads=1, seed=7)


def test_pruned_checkpoint_keeps_the_other_layers_renumbered(source, tmp_path):
    dest = prune_layers(source, drop=[0, 2], dest=tmp_path / "pruned")

    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    for new, old in enumerate([1, 3]):
        mine = model.model.layers[new].state_dict()
        theirs = original.model.layers[old].state_dict()
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), (new, old, name)
        # Guard the check itself: the layers differ from each other.
        other = original.model.layers[4 - old].state_dict()  # the other kept layer
        assert not torch.equal(mine["mlp.up_proj.weight"], other["mlp.up_proj.weight"])
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(model.get_parameter(name), original.get_parameter(name))

    # Tensors on disk are renamed, not only reloaded; tokenizer and the rest are copied.
    names = load_file(dest / "model.safetensors")
    assert sorted({k.split(".")[2] for k in names if ".layers." in k}) == ["0", "1"]
    assert AutoTokenizer.from_pretrained(dest).chat_template
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            assert (dest / file.name).exists(), file.name
    assert json.loads((dest / "config.json").read_text())["num_hidden_layers"] == 2

    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_pruned_checkpoint_is_cached_and_reused(source):
    first = prune_layers(source, drop=[3])
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    again = PrunedModel(base=str(source), drop_layers=[3]).path()
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == mtime
    assert "drop3" in first.name
    assert PrunedModel(base=str(source)).path() == source


@pytest.mark.parametrize("drop", [[4], [-1], [1, 1], [0, 1, 2, 3]])
def test_bad_drop_lists_are_refused(source, drop, tmp_path):
    with pytest.raises(ValueError, match="drop"):
        prune_layers(source, drop, dest=tmp_path / "x")
