"""Offline model checkpoints: SmolLM2-135M-Instruct converted from GGUF, tiny random models,
layer-pruned copies."""

from forge.models.assets import (
    DEFAULT_MODEL,
    TINY_FAMILIES,
    check_model,
    load_tokenizer,
    models_dir,
    resolve_model,
    smollm2,
    tiny_model,
)
from forge.models.prune import PrunedModel, prune_layers

__all__ = [
    "DEFAULT_MODEL",
    "TINY_FAMILIES",
    "check_model",
    "load_tokenizer",
    "PrunedModel",
    "models_dir",
    "prune_layers",
    "resolve_model",
    "smollm2",
    "tiny_model",
]
