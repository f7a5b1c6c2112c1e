"""forge's cache folder on this machine, shared by what forge keeps between runs (converted
models, calibrated phase costs); a module of its own so that every layer can find it."""

import os
from pathlib import Path


def cache_root() -> Path:
    """forge's cache on this machine: `$FORGE_CACHE` (default `~/.cache/forge`)."""
    return Path(os.environ.get("FORGE_CACHE", "~/.cache/forge")).expanduser()
