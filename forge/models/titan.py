"""torchtitan models from Hugging Face checkpoints: Llama 3 and Qwen 3 families.

torchtitan 0.3.0 has no HF config -> model config mapping, so `titan_config` builds one from a
checkpoint's config.json; weights go through torchtitan's own state-dict adapters (which permute
q/k for Llama's interleaved RoPE and re-tie embeddings that the checkpoint stores once). Attention
is SDPA, causal: the one backend with a CPU backward; batches are padded, never packed.
"""

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from forge.models.titan_compat import compile_on_first_call

_LINEAR_INIT = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBED_INIT = {"weight": partial(nn.init.normal_, std=0.02)}


@dataclass
class TitanModel:
    """A torchtitan model config with its family and HF state-dict adapter."""

    family: str  # "llama" or "qwen3"
    config: Any  # torchtitan Model.Config; .build() makes the module
    adapter: Any  # torchtitan StateDictAdapter: from_hf / to_hf


def _families() -> dict[str, tuple]:
    with compile_on_first_call():  # torchtitan compiles flex attention at import
        from torchtitan.models.common import ComplexRoPE, CosSinRoPE
        from torchtitan.models.llama3 import Llama3Model
        from torchtitan.models.llama3.model import Llama3TransformerBlock
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
        from torchtitan.models.qwen3 import Qwen3Model
        from torchtitan.models.qwen3.model import Qwen3TransformerBlock
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    return {
        "llama": (Llama3Model, Llama3TransformerBlock, ComplexRoPE, Llama3StateDictAdapter),
        "qwen3": (Qwen3Model, Qwen3TransformerBlock, CosSinRoPE, Qwen3StateDictAdapter),
    }


def titan_model(checkpoint: str | Path, max_seq_len: int | None = None) -> TitanModel:
    """The torchtitan config and adapter for the HF checkpoint folder `checkpoint`.

    Raises ValueError, naming the field, for architectures torchtitan's families cannot express.
    """
    hf = json.loads((Path(checkpoint) / "config.json").read_text())
    family = hf.get("model_type")
    families = _families()
    if family not in families:
        raise ValueError(f"{checkpoint}: model_type {family!r} is not supported (llama, qwen3)")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf.get(flag):
            raise ValueError(f"{checkpoint}: {flag} is not supported by torchtitan's {family}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{checkpoint}: hidden_act {hf['hidden_act']!r} is not supported")
    model_cls, block_cls, rope_cls, adapter_cls = families[family]
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    eps = float(hf.get("rms_norm_eps", 1e-6))
    rope = _rope(hf, rope_cls, head_dim, max_seq_len or hf.get("max_position_embeddings", 4096))
    layers = [
        _block(block_cls, hf, family, dim, heads, head_dim, eps, rope)
        for _ in range(hf["num_hidden_layers"])
    ]
    config = _model_config(model_cls, hf, dim, eps, layers)
    return TitanModel(family, config, adapter_cls(config, None))


def _rope(hf: dict, rope_cls: Any, head_dim: int, max_seq_len: int) -> Any:
    # transformers 5 keeps RoPE settings in rope_parameters; 4.x in rope_theta + rope_scaling.
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    kwargs: dict[str, Any] = dict(dim=head_dim, max_seq_len=max_seq_len, theta=theta)
    if kind == "default":
        kwargs["scaling"] = "none"
    elif kind == "llama3" and rope_cls.__name__ == "ComplexRoPE":
        kwargs.update(
            scaling="llama",
            scaling_factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    else:  # yarn also scales attention in HF, which torchtitan's RoPE does not
        raise ValueError(f"rope_type {kind!r} is not supported")
    return rope_cls.Config(**kwargs)


def _block(block_cls, hf, family, dim, heads, head_dim, eps, rope) -> Any:
    from torchtitan.models.common import RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    def norm(size: int) -> Any:
        return RMSNorm.Config(normalized_shape=size, eps=eps, param_init=_NORM_INIT)

    explicit_head_dim = head_dim if family == "qwen3" or head_dim != dim // heads else None
    attention = make_gqa_config(
        dim=dim,
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=explicit_head_dim,
        wqkv_param_init=_LINEAR_INIT,
        wo_param_init=_LINEAR_INIT,
        inner_attention=ScaledDotProductAttention.Config(),  # flex has no CPU backward
        fuse_qkv=False,  # a fused wqkv breaks torch.distributed's state-dict helpers
        rope=rope,
        qk_norm=norm(head_dim) if family == "qwen3" else None,
    )
    ffn = make_ffn_config(
        dim=dim,
        hidden_dim=hf["intermediate_size"],
        w1_param_init=_LINEAR_INIT,
        w2w3_param_init=_LINEAR_INIT,
    )
    return block_cls.Config(
        attention_norm=norm(dim), ffn_norm=norm(dim), attention=attention, feed_forward=ffn
    )


def _model_config(model_cls, hf, dim, eps, layers) -> Any:
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    vocab = hf["vocab_size"]
    return model_cls.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=_EMBED_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=layers,
    )


def build(
    model: TitanModel, *, meta: bool = False, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Builds the module; on the meta device (to parallelize first, then materialise) or on CPU
    with random weights and its RoPE cache."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta" if meta else "cpu"):
            module = model.config.build()
    finally:
        torch.set_default_dtype(previous)
    if not meta:
        with torch.no_grad():
            module.init_states(buffer_device=torch.device("cpu"))
    return module


def hf_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, HF-named."""
    from safetensors.torch import load_file

    state_dict: dict[str, torch.Tensor] = {}
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        state_dict.update(load_file(file))
    return state_dict


def load_pretrained(checkpoint: str | Path, max_seq_len: int | None = None) -> nn.Module:
    """A plain (unsharded) torchtitan model with the checkpoint's weights, in eval mode."""
    model = titan_model(checkpoint, max_seq_len)
    module = build(model)
    module.load_state_dict(model.adapter.from_hf(hf_state_dict(checkpoint)), strict=True)
    return module.eval()


# Positions x sequences whose logits exist at once: [chunk, vocab] floats (0.4 GB at SmolLM2's
# vocabulary), however long the batch.
LOGITS_CHUNK_TOKENS = 2048


def token_logprobs(
    module: nn.Module,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = LOGITS_CHUNK_TOKENS,
    first: int = 0,
) -> torch.Tensor:
    """log p(input_ids[:, j+1] | input_ids[:, :j+1]) for every position j: shape [B, T-1].

    Logits are divided by `temperature` first, as the generator samples. They are computed
    `chunk_tokens` at a time from the final hidden states, and, when there is more than one
    chunk, recomputed in the backward pass: no [B, T, vocab] tensor ever exists. Positions
    before `first` (e.g. every row's prompt) get no logits, and 0 in the output.
    """
    (actual,) = _over_chunks(module, input_ids, temperature, chunk_tokens, first, _actual)
    return actual


def candidate_logprobs(
    module: nn.Module,
    input_ids: torch.Tensor,
    candidates: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = LOGITS_CHUNK_TOKENS,
    first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs`, and log p(c | input_ids[:, :j+1]) of each candidate token c.

    Args:
        candidates: [B, T-1, k] token ids per position (e.g. a teacher's top k).

    Returns:
        ([B, T-1] logprobs of the actual next tokens, [B, T-1, k] logprobs of the candidates).
    """
    actual, chosen = _over_chunks(
        module, input_ids, temperature, chunk_tokens, first, _with_candidates, candidates
    )
    return actual, chosen


@torch.no_grad()
def top_logprobs(
    module: nn.Module,
    input_ids: torch.Tensor,
    k: int,
    temperature: float = 1.0,
    chunk_tokens: int = LOGITS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_logprobs`, and the k most likely next tokens at every position with their logprobs.

    Returns:
        ([B, T-1] logprobs of the actual next tokens, [B, T-1, k] top ids, [B, T-1, k] their
        logprobs, most likely first).
    """
    actual, ids, values = _over_chunks(
        module, input_ids, temperature, chunk_tokens, 0, partial(_with_top, k=k)
    )
    return actual, ids, values


def _over_chunks(
    module: nn.Module,
    input_ids: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    first: int,
    per_chunk: Any,
    *per_position: torch.Tensor,
) -> list[torch.Tensor]:
    """Runs the model up to its final norm once, then `per_chunk(logits, targets, *slices)` on
    the tempered logits of a few positions at a time, from position `first` on; concatenates
    the outputs along T-1, zeros for the positions before `first`.

    With gradients on and more than one chunk, each chunk is checkpointed: its logits are
    recomputed in the backward pass instead of kept, so memory holds one chunk's logits, not
    the batch's. A single chunk is not: recomputing it would cost a pass over the vocabulary
    and save no peak memory, since its backward runs first.
    """
    hidden = _final_hidden(module, input_ids)[:, first:-1]
    targets = input_ids[:, first + 1 :]
    per_position = tuple(t[:, first:] for t in per_position)
    positions = hidden.shape[1]
    count = max(1, math.ceil(positions / max(1, chunk_tokens // input_ids.shape[0])))
    width = math.ceil(positions / count)  # equal chunks: a small last one computes slowly
    weight = _lm_head_weight(module)

    def chunk(h: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = nn.functional.linear(h, weight).float()
        return per_chunk(logits if temperature == 1.0 else logits / temperature, *rest)

    outputs = []
    for start in range(0, positions, width):
        parts = [t[:, start : start + width] for t in (hidden, targets, *per_position)]
        if hidden.requires_grad and count > 1:
            outputs.append(checkpoint(chunk, *parts, use_reentrant=False))
        else:
            outputs.append(chunk(*parts))
    return [_pad_front(torch.cat(pieces, dim=1), first) for pieces in zip(*outputs, strict=True)]


def _pad_front(values: torch.Tensor, count: int) -> torch.Tensor:
    """`values` with `count` zero positions before its first, along dim 1."""
    if not count:
        return values
    zeros = values.new_zeros((values.shape[0], count, *values.shape[2:]))
    return torch.cat([zeros, values], dim=1)


def _final_hidden(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The decoder's output before its lm_head: [B, T, dim]."""
    # torchtitan 0.3.0's Decoder skips its lm_head when this attribute is set (its own chunked
    # loss uses it); an attribute, not an argument, of the forward.
    module._skip_lm_head = True
    try:
        return module(input_ids)
    finally:
        module._skip_lm_head = False


def _lm_head_weight(module: nn.Module) -> torch.Tensor:
    """The lm_head's whole weight, differentiably: gathered here once if FSDP shards it.

    Calling an FSDP-managed lm_head module once per chunk (and again when the backward pass
    recomputes the chunk) leaves FSDP's unshard/reshard bookkeeping out of step; one gather
    whose backward reduce-scatters the gradient does not.
    """
    from torch.distributed.tensor import DTensor

    weight = module.lm_head.weight
    return weight.full_tensor() if isinstance(weight, DTensor) else weight


def _actual(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
    # cross_entropy fuses log-softmax and gather: no log-prob tensor the size of the logits.
    nll = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (-nll.view(targets.shape),)


def _with_candidates(
    logits: torch.Tensor, targets: torch.Tensor, candidates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    actual = logits.gather(-1, targets[..., None]) - log_z
    return actual.squeeze(-1), logits.gather(-1, candidates) - log_z


def _with_top(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    actual = logits.gather(-1, targets[..., None]) - log_z
    values, ids = logits.topk(k, dim=-1)
    return actual.squeeze(-1), ids, values - log_z
