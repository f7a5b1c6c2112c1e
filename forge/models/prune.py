"""Layer-pruned copies of a checkpoint: a smaller student initialised from its teacher.

    student = prune_layers(smollm2(), drop=[19, 22, 27])   # 27 of SmolLM2's 30 layers

SmolLM2-135M-Instruct is fragile: on one-digit additions (greedy, 64 held-out prompts) the
teacher scores 0.72, dropping layers [22, 27] 0.42, [19, 22, 27] 0.24, [17, 19, 22, 27] 0.15,
and any 4 consecutive upper layers (24-27) ~0.02 (gibberish).

The copy keeps every decoder layer but the dropped ones, renumbered `model.layers.0..N-1` in
their original order, with everything else (embeddings, final norm, tokenizer, generation
config) unchanged. It is cached under `models_dir()` by source name and dropped layers, and
built once, atomically, like the other checkpoints (forge.models.assets).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from forge.config import field_error, require
from forge.models.assets import (
    DEFAULT_MODEL,
    _build_once,
    check_model,
    models_dir,
    resolve_model,
)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass
class PrunedModel:
    """A pruned model for configs: `base` (a name `resolve_model` knows) less `drop_layers`.

    Args:
        base: the model pruned: a name `resolve_model` knows, or a local HF checkpoint folder.
        drop_layers: indices (0-based) of the decoder layers left out.
    """

    base: str = DEFAULT_MODEL
    drop_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        require(self, "base", bool, "a model name or folder")
        require(self, "drop_layers", lambda layers: min(layers, default=0) >= 0, "indices >= 0")

    def check_available(self) -> None:
        """Raises FieldError unless `base` resolves on this machine (nothing is built)."""
        with field_error("base"):
            check_model(self.base)

    def path(self) -> Path:
        """The pruned checkpoint folder (the base itself when nothing is dropped)."""
        base = resolve_model(self.base)
        return prune_layers(base, self.drop_layers) if self.drop_layers else base


def prune_layers(source: str | Path, drop: list[int], dest: Path | None = None) -> Path:
    """Return an HF checkpoint of `source` without the decoder layers `drop`, building it once.

    Args:
        source: a model name `resolve_model` knows or a local HF checkpoint folder.
        drop: indices (0-based, in the source) of the decoder layers to leave out.
        dest: where to write it; default `models_dir() / "<source name>-drop<layers>-<hash>"`,
            the hash telling apart sources that share a folder name. An existing folder there
            is reused as is.

    Raises:
        ValueError: an index is out of range or repeated, or every layer would be dropped.
    """
    src = resolve_model(source)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    dropped = sorted(set(drop))
    if len(dropped) != len(drop) or any(not 0 <= i < layers for i in dropped):
        raise ValueError(f"drop must list distinct layers in [0, {layers}), got {drop}")
    if len(dropped) == layers:
        raise ValueError(f"drop {drop} leaves none of the {layers} layers")
    if dest is None:
        tag = hashlib.sha1(str(src.resolve()).encode()).hexdigest()[:8]
        name = "_".join(map(str, dropped)) or "none"
        dest = models_dir() / f"{src.name}-drop{name}-{tag}"
    kept = [i for i in range(layers) if i not in dropped]
    what = f"pruning {src.name}: keeping {len(kept)} of {layers} layers"
    return _build_once(Path(dest), lambda tmp: _write_pruned(src, tmp, kept), what)


def _write_pruned(src: Path, out: Path, kept: list[int]) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    new_index = {old: new for new, old in enumerate(kept)}
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                match = _LAYER.match(name)
                if match is None:
                    tensors[name] = f.get_tensor(name)
                elif int(match[1]) in new_index:
                    new_name = f"model.layers.{new_index[int(match[1])]}.{match[2]}"
                    tensors[new_name] = f.get_tensor(name)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

    config = json.loads((src / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config["num_hidden_layers"] = len(kept)
    # Per-layer settings (transformers 5 writes `layer_types`) follow their layers.
    for key, value in config.items():
        if key.startswith("layer_") and isinstance(value, list) and len(value) == layers:
            config[key] = [value[i] for i in kept]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    # Everything else (tokenizer, chat template, generation config) is copied as is; the
    # weights are rewritten into one file, so a shard index would be wrong.
    for item in src.iterdir():
        if item.suffix == ".safetensors" or item.name in ("config.json", _SHARD_INDEX):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)


_SHARD_INDEX = "model.safetensors.index.json"
