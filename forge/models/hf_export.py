"""Export trained weights as a Hugging Face checkpoint folder that transformers and vLLM load.

    save_hf(adapter.to_hf(full_state_dict), source=resolve_model(cfg.model), dest=Path("out"))
    save_peft(peft_tensors, peft_config(lora, base), dest=Path("out"))   # a LoRA adapter

The folder is the source checkpoint's folder with its weights replaced: config.json, tokenizer
files, chat template, generation config and any other non-weight file are copied as they are,
and the weights go into one `model.safetensors` under their HF names. It is written into a
temporary folder next to `dest` and renamed into place once complete, so a folder at `dest` is
always a whole checkpoint: an interrupted export leaves the previous one (or nothing) there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

WEIGHTS_NAME = "model.safetensors"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"

# Files that hold the source's weights (or index them): the export writes its own, and a stale
# copy next to it would be loaded too (vLLM and transformers read every *.safetensors file).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def save_hf(state_dict: dict[str, torch.Tensor], source: str | Path, dest: str | Path) -> Path:
    """Write `state_dict` (HF names) with `source`'s non-weight files as an HF folder at `dest`.

    Args:
        state_dict: the full, unsharded weights under Hugging Face names (what a torchtitan
            adapter's `to_hf` returns). Tensors may live on any device, be views or alias
            each other: they are written as contiguous CPU copies, in their own dtype.
        source: the HF checkpoint folder the model was loaded from; its config.json describes
            the exported weights too (same architecture and shapes).
        dest: the folder to create. An existing one is replaced, but only after the new one is
            complete.

    Returns:
        `dest` as a Path.

    With tied embeddings (`tie_word_embeddings` true) `lm_head.weight` is written only if the
    source checkpoint holds one: transformers and vLLM re-tie it from the embedding, and the
    export should look like the checkpoint it came from.
    """
    source, dest = Path(source), Path(dest).expanduser().absolute()
    config = json.loads((source / "config.json").read_text())
    tensors = _tie_like_source(dict(state_dict), config, _weight_names(source))
    _check_against_source(tensors, source)

    def write(tmp: Path) -> None:
        _copy_non_weight_files(source, tmp)
        _write_safetensors(tensors, tmp / WEIGHTS_NAME)

    _write_whole(dest, write)
    return dest


def save_peft(tensors: dict[str, torch.Tensor], config: dict, dest: str | Path) -> Path:
    """Write a LoRA adapter as a PEFT folder at `dest`: adapter_config.json (`config`, e.g.
    forge.models.lora.peft_config) and adapter_model.safetensors (`tensors`, PEFT names).
    PEFT's `PeftModel.from_pretrained` and vLLM's `LoRARequest` load it. Replaced whole, as in
    `save_hf`. Returns `dest` as a Path."""
    dest = Path(dest).expanduser().absolute()

    def write(tmp: Path) -> None:
        (tmp / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        _write_safetensors(tensors, tmp / ADAPTER_WEIGHTS_NAME)

    _write_whole(dest, write)
    return dest


def _write_whole(dest: Path, write: Callable[[Path], None]) -> None:
    """Runs `write` on a temporary folder beside `dest`, then renames it to `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Same parent as dest, so the final rename stays on one filesystem and is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.export-", dir=dest.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is read by other users
        write(tmp)
        _fsync_dir(tmp)
        _replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tie_like_source(
    tensors: dict[str, torch.Tensor], config: dict, source_names: set[str]
) -> dict[str, torch.Tensor]:
    """Drops or adds lm_head.weight so that tied checkpoints keep the source's layout.

    torchtitan's adapters leave out `output.weight` when weights are tied; a checkpoint that
    stores the tied head anyway (some do) gets it back as a copy of the embedding, so a loader
    that expects it finds it.
    """
    if not config.get("tie_word_embeddings", False):
        return tensors
    if "lm_head.weight" not in source_names:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def _weight_names(source: Path) -> set[str]:
    """The tensor names stored in the source's safetensors files (headers only, no data)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in source.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def _check_against_source(tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Refuses weights whose names or shapes differ from the source's: config.json is copied
    from it, so such a folder would fail to load, or load the wrong architecture."""
    from safetensors import safe_open

    expected: dict[str, tuple[int, ...]] = {}
    for file in source.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                expected[name] = tuple(f.get_slice(name).get_shape())
    if not expected:  # a source without safetensors (e.g. .bin only): nothing to compare with
        return
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    # Buffers some checkpoints store (rotary inv_freq) are rebuilt by every loader.
    expected = {k: v for k, v in expected.items() if not k.endswith("rotary_emb.inv_freq")}
    if got != expected:
        wrong = sorted(set(got.items()) ^ set(expected.items()))[:6]
        raise ValueError(f"exported weights do not match {source}'s names and shapes: {wrong}")


def _copy_non_weight_files(source: Path, out: Path) -> None:
    """Copies everything in `source` but its weights: config, tokenizer, chat template,
    generation config, README, license... so the export is served exactly like the source."""

    def ignore(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n.endswith(_WEIGHT_SUFFIXES) or n in _WEIGHT_INDEXES}

    shutil.copytree(source, out, ignore=ignore, dirs_exist_ok=True)


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Writes contiguous CPU copies; tensors that share memory are written as separate copies
    (safetensors refuses aliased tensors, and one-process state dicts alias live parameters)."""
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        t = tensors[name].detach()
        if hasattr(t, "full_tensor"):  # a DTensor: the caller should pass full tensors
            raise TypeError(f"{name} is a DTensor: pass a full (gathered) state dict")
        t = t.to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key in seen:
            t = t.clone()
        seen.add(key)
        out[name] = t
    # metadata format "pt": transformers refuses safetensors files without it.
    save_file(out, str(path), metadata={"format": "pt"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    """Flushes `folder`'s entries, so a crash after the rename cannot leave empty files."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: Path, dest: Path) -> None:
    """Renames the complete `tmp` to `dest`. An existing `dest` is first moved aside, then
    removed: Linux cannot rename a folder over a non-empty one, and moving it aside keeps it
    whole until the new one is in place (it is put back if that rename fails)."""
    if not dest.exists():
        os.rename(tmp, dest)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    os.rename(dest, old / dest.name)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(old / dest.name, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)
