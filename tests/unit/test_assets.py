"""Offline model checkpoints: SmolLM2 converted from GGUF, tiny random models, name resolution.

These use the real cache (`$FORGE_CACHE/models`, default `~/.cache/forge/models`) so that the
one-time SmolLM2 conversion (~20-40 s) is shared with every later test and run.
"""

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from forge.models import assets
from forge.models.assets import (
    DEFAULT_MODEL,
    check_model,
    models_dir,
    resolve_model,
    smollm2,
    tiny_model,
)


@pytest.fixture(scope="session")
def smol() -> Path:
    return smollm2()


def _load(path: Path):
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return tokenizer, model.eval()


def _next_token(tokenizer, model, prompt: str) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    return tokenizer.decode(logits[0, -1].argmax())


def test_smollm2_loads_offline_and_answers(smol):
    tokenizer, model = _load(smol)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert model.dtype == torch.float32
    assert _next_token(tokenizer, model, "The capital of France is") == " Paris"


def test_smollm2_ties_embeddings_without_saving_lm_head(smol):
    assert AutoConfig.from_pretrained(smol, local_files_only=True).tie_word_embeddings
    with safe_open(smol / "model.safetensors", "pt") as f:
        names = set(f.keys())
    # As in the upstream HF checkpoint: vLLM and torchtitan rebuild lm_head from the embedding.
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_smollm2_second_call_reuses_cache(smol, monkeypatch):
    weights = smol / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def reconvert(out: Path) -> None:
        raise AssertionError("the GGUF file was converted again")

    monkeypatch.setattr(assets, "_convert_smollm2", reconvert)
    assert smollm2() == smol
    assert weights.stat().st_mtime_ns == mtime


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    def interrupted(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(assets, "_convert_smollm2", interrupted)
    with pytest.raises(KeyboardInterrupt):
        smollm2(tmp_path / "smol")
    assert list(tmp_path.iterdir()) == []


def test_forge_cache_env_sets_models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path))
    assert models_dir() == tmp_path / "models"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_model_loads_with_smollm2_tokenizer(family):
    path = tiny_model(family)
    tokenizer, model = _load(path)
    config = model.config
    assert config.model_type == family
    assert config.head_dim == 64 and config.vocab_size == len(tokenizer) == 49152
    assert config.tie_word_embeddings and tokenizer.chat_template
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], 49152)


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    first = load_file(tiny_model("qwen3", seed=3, path=tmp_path / "a") / "model.safetensors")
    again = load_file(tiny_model("qwen3", seed=3, path=tmp_path / "b") / "model.safetensors")
    other = load_file(tiny_model("qwen3", seed=4, path=tmp_path / "c") / "model.safetensors")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_tiny_model_rejects_unknown_family():
    with pytest.raises(ValueError, match="'gpt2'"):
        tiny_model("gpt2")


def test_resolve_model_names_and_paths(smol, tmp_path):
    assert resolve_model(DEFAULT_MODEL) == smol
    assert resolve_model(f"HuggingFaceTB/{DEFAULT_MODEL}") == smol
    assert resolve_model("tiny-qwen3") == tiny_model("qwen3")
    assert resolve_model(str(smol)) == smol


@pytest.mark.parametrize("junk", ["gpt-5", "org/some-model", "/nonexistent/dir", ".", ""])
def test_resolve_model_rejects_junk(junk):
    for check in (check_model, resolve_model):
        with pytest.raises(ValueError, match=rf"unknown model {re.escape(repr(junk))}.*tiny-llama"):
            check(junk)


def test_an_empty_name_is_not_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="unknown model ''"):
        check_model("")


def test_check_model_builds_and_reads_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "_build_once", lambda *args: pytest.fail("built a checkpoint"))
    (tmp_path / "config.json").write_text("not json: never read")
    for name in (DEFAULT_MODEL, "tiny-llama", "tiny-qwen3", str(tmp_path)):
        check_model(name)


def test_load_tokenizer_takes_the_backend_directly_and_matches_autotokenizer(smol, tmp_path):
    """A checkpoint whose tokenizer is the generic backend skips AutoTokenizer and gets the
    same tokenizer; one naming another class still goes through AutoTokenizer."""
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    for path in (smol, tiny_model("llama")):
        direct, auto = assets.load_tokenizer(str(path)), AutoTokenizer.from_pretrained(path)
        assert type(direct) is type(auto)
        text = "Tokens, <|im_start|> 12+34\n"
        assert direct(text).input_ids == auto(text).input_ids
        render = dict(tokenize=False, add_generation_prompt=True)
        rendered = direct.apply_chat_template(chat, **render)
        assert rendered == auto.apply_chat_template(chat, **render)
        assert direct.all_special_tokens == auto.all_special_tokens
        assert (direct.eos_token_id, direct.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for file in smol.iterdir():
        (renamed / file.name).symlink_to(file)
    config = (smol / "tokenizer_config.json").read_text()
    (renamed / "tokenizer_config.json").unlink()
    (renamed / "tokenizer_config.json").write_text(
        config.replace('"TokenizersBackend"', '"GPT2Tokenizer"')
    )
    other = assets.load_tokenizer(str(renamed))
    assert type(other).__name__ == "GPT2Tokenizer"  # AutoTokenizer's choice, not the backend
    assert other("12+34").input_ids == direct("12+34").input_ids
