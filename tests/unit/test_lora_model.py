"""LoRA on tiny torchtitan models: what trains, PEFT's layout (checked against PEFT itself on
Hugging Face's models), merging, dropout and the config's checks."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from forge.actors.vllm.engine import checkpoint_shapes
from forge.config import ConfigError, load_config
from forge.loop.config import RunConfig
from forge.models import tiny_model
from forge.models.hf_export import save_peft
from forge.models.hf_layout import HfLayout
from forge.models.lora import (
    LoRAConfig,
    PeftLayout,
    add_dropout,
    initial_adapters,
    is_adapter,
    merge,
    peft_config,
    peft_shapes,
    with_lora,
)
from forge.models.titan import build, hf_state_dict, titan_model, token_logprobs

CFG = LoRAConfig(rank=4, alpha=8.0)


def lora_model(path, cfg: LoRAConfig = CFG, seed: int = 0) -> tuple:
    """A LoRA model on `path`'s weights with random (nonzero) B: it differs from the base."""
    titan = with_lora(titan_model(path), cfg)
    model = build(titan)
    weights = titan.adapter.from_hf(hf_state_dict(path))
    weights.update(initial_adapters(model, seed))
    model.load_state_dict(weights, strict=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return titan, model.eval()


def split(model) -> tuple[dict, dict]:
    state_dict = model.state_dict()
    base = {k: v for k, v in state_dict.items() if not is_adapter(k)}
    return base, {k: v for k, v in state_dict.items() if is_adapter(k)}


def test_only_the_targeted_layers_get_adapters_and_only_adapters_train():
    path = tiny_model("llama", seed=0)
    cfg = LoRAConfig(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])
    model = build(with_lora(titan_model(path), cfg))
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trained and all(is_adapter(n) for n in trained)
    modules = {n.split(".lora_")[0].split(".")[-1] for n in trained}
    assert modules == {"wq", "wk", "wv", "w2"}  # k and v: both of torchtitan's wkv


def test_adapters_start_at_zero_effect_and_the_same_for_a_seed():
    path = tiny_model("llama", seed=0)
    titan = with_lora(titan_model(path), CFG)
    model = build(titan)
    first, again = initial_adapters(model, 3), initial_adapters(model, 3)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert all(not v.any() for k, v in first.items() if "lora_b" in k)
    assert all(v.abs().max() > 0 for k, v in first.items() if "lora_a" in k)
    weights = titan.adapter.from_hf(hf_state_dict(path)) | first
    model.load_state_dict(weights, strict=True)
    base = build(titan_model(path))
    base.load_state_dict(titan.adapter.from_hf(hf_state_dict(path)))
    ids = torch.randint(0, 49152, (2, 10))
    assert torch.equal(token_logprobs(model.eval(), ids), token_logprobs(base.eval(), ids))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_on_the_hf_model_scores_like_ours_and_so_does_the_merged_model(family, tmp_path):
    """Llama's q and k rows are in torchtitan's rotary order: their lora_B rows move to HF's."""
    path = tiny_model(family, seed=0, init_std=0.5)
    titan, model = lora_model(path)
    base, adapters = split(model)
    layout = PeftLayout(HfLayout.learn(titan.adapter, base), adapters)
    tensors = layout(adapters)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == peft_shapes(
        CFG, checkpoint_shapes(path)
    )
    save_peft(tensors, peft_config(CFG, str(path)), tmp_path / "adapter")
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = token_logprobs(model, ids)

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        logits = peft(ids).logits[:, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert (theirs - ours).abs().max() < 1e-4

    merged = build(titan_model(path))
    merged.load_state_dict(merge(model.state_dict(), CFG))
    plain = build(titan_model(path))
    plain.load_state_dict(base)
    assert (token_logprobs(merged.eval(), ids) - ours).abs().max() < 1e-4
    assert (token_logprobs(plain.eval(), ids) - ours).abs().max() > 1e-3  # the adapter counts


def test_dropout_acts_on_the_adapters_in_training_only():
    path = tiny_model("llama", seed=0)
    _, model = lora_model(path, LoRAConfig(rank=4, dropout=0.5))
    add_dropout(model, 0.5)
    ids = torch.randint(0, 49152, (2, 10))
    evaluated = [token_logprobs(model.eval(), ids) for _ in range(2)]
    assert torch.equal(*evaluated)
    torch.manual_seed(0)
    trained = [token_logprobs(model.train(), ids).detach() for _ in range(2)]
    assert not torch.equal(*trained)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rank": 0}, "rank >= 1"),
        ({"dropout": 1.0}, "dropout < 1"),
        ({"target_modules": []}, "nothing would train"),
        ({"target_modules": ["q_proj", "k_proj"]}, "k_proj and v_proj"),
    ],
)
def test_bad_lora_configs_are_refused_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**changes)


def test_an_unknown_target_is_refused_by_the_loader():
    with pytest.raises(ConfigError, match=r"weight_sync.lora.target_modules\[0\].*q_proj"):
        load_config(RunConfig, None, ["weight_sync.lora={target_modules: [qkv]}"])


def test_the_generator_serves_what_the_trainer_trains():
    cfg = load_config(RunConfig, None, ["weight_sync.lora.rank=16", "eval.interval=1"])
    roles = {role.name: role.args for role in cfg.roles()}
    # One section for both: the trainer trains the adapter the generators serve.
    assert roles["trainer"][1] is roles["generator"][1] is cfg.weight_sync
    assert cfg.weight_sync.served_adapter() == cfg.weight_sync.lora == LoRAConfig(rank=16)
    assert load_config(RunConfig, None, []).weight_sync.served_adapter() is None
    merged = load_config(RunConfig, None, ["weight_sync.lora.publish=merged"])
    assert merged.weight_sync.lora.publish == "merged"
    assert merged.weight_sync.served_adapter() is None
    for old in ("trainer.lora.rank=16", "generator.lora.rank=8"):
        with pytest.raises(ConfigError, match="lora: moved to weight_sync.lora"):
            load_config(RunConfig, None, [old])
