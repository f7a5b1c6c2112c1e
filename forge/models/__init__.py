"""Offline model checkpoints: SmolLM2-135M-Instruct converted from GGUF, tiny random models."""

from forge.models.assets import (
    DEFAULT_MODEL,
    TINY_FAMILIES,
    models_dir,
    resolve_model,
    smollm2,
    tiny_model,
)

__all__ = ["DEFAULT_MODEL", "TINY_FAMILIES", "models_dir", "resolve_model", "smollm2", "tiny_model"]
