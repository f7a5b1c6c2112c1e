"""Hugging Face export of a trained TitanTrainer: transformers and vLLM load the folder as is
and score tokens as the trainer does.

One module-scoped pair of trainers (1 and 2 processes) trains one step and exports; one vLLM
engine serves the 2-process export. Tiny models use a large init std, so next-token
distributions are peaked and greedy decoding has no near-ties between implementations.
"""

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from forge.actors.generator import Generator, GeneratorConfig
from forge.actors.trainer import OptimizerConfig, TitanTrainer, TrainerConfig
from forge.controller import shutdown
from forge.data import Completion, Episode
from forge.models import tiny_model
from forge.models.hf_export import save_hf
from forge.weights.sync_config import WeightSyncConfig
from forge.weights.transport import TransportConfig

pytestmark = pytest.mark.integration

INIT_STD = 0.5
LR = 1e-2  # AdamW's first step moves every weight by ~lr: far above float noise
PROMPTS = ["The answer is", "Once upon a time", "1 2 3 4"]


def source() -> Path:
    return tiny_model("llama", seed=0, init_std=INIT_STD)


def episodes(n: int, seed: int) -> list[Episode]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(49152) for _ in range(rng.randint(3, 8))]
        tokens = [rng.randrange(49152) for _ in range(rng.randint(2, 12))]
        completion = Completion(prompt, tokens, "", [0.0] * len(tokens), [0] * len(tokens), "")
        out.append(Episode(f"e{i}", f"g{i}", completion, advantage=0.0))
    return out


PAIRS = [(e.completion.prompt_ids, e.completion.token_ids) for e in episodes(4, seed=9)]


def hf_model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], token_ids: list[int]
) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
async def processes():
    """Stops every Monarch process the module started, once its tests are done."""
    yield
    await shutdown()


@pytest.fixture(scope="module")
async def exports(processes, tmp_path_factory) -> dict[int, tuple[Path, list[list[float]]]]:
    """{procs: (export folder, the trainer's logprobs of PAIRS)} after one SFT step each."""
    root = tmp_path_factory.mktemp("hf_export")

    async def train_and_export(procs: int) -> tuple[Path, list[list[float]]]:
        cfg = TrainerConfig(
            model=str(source()),
            objective="sft",
            optimizer=OptimizerConfig(lr=LR),
        )
        sync = WeightSyncConfig(TransportConfig(path=str(root / f"transport{procs}")))
        trainer = await TitanTrainer.options(procs=procs).as_actor(cfg, sync)
        batch = episodes(8, seed=procs)
        await trainer.train_step.call([batch[r::procs] for r in range(procs)])
        paths = await trainer.export_hf.call(str(root / f"export{procs}"))
        assert list(paths.values()) == [str(root / f"export{procs}")] * procs
        # Every rank runs the forward pass: FSDP gathers each layer's weights collectively.
        logprobs = list((await trainer.compute_logprobs.call(PAIRS)).values())
        return root / f"export{procs}", logprobs[0]

    one, two = await asyncio.gather(train_and_export(1), train_and_export(2))
    return {1: one, 2: two}


@pytest.mark.parametrize("procs", [1, 2])
async def test_transformers_loads_the_export_and_scores_like_the_trainer(exports, procs):
    folder, trainer_lp = exports[procs]
    exported = load_file(folder / "model.safetensors")
    original = load_file(source() / "model.safetensors")
    # Same names and shapes as the source checkpoint; tied: no lm_head.weight, as in the source.
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in original.items()}
    assert "lm_head.weight" not in exported
    moved = max((exported[k] - original[k]).abs().max().item() for k in original)
    assert moved > LR / 2, f"export holds the source weights (max change {moved:.2e})"
    assert json.loads((folder / "config.json").read_text()) == json.loads(
        (source() / "config.json").read_text()
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (folder / name).read_bytes() == (source() / name).read_bytes(), name

    model = hf_model(folder)
    ours = torch.cat([hf_logprobs(model, p, c) for p, c in PAIRS])
    theirs = torch.tensor([lp for row in trainer_lp for lp in row])
    worst = (ours - theirs).abs().max().item()
    before = torch.cat([hf_logprobs(hf_model(source()), p, c) for p, c in PAIRS])
    print(
        f"{procs} proc(s): transformers on the export vs trainer, max |dlogprob| {worst:.2e} "
        f"(training moved them by up to {(before - theirs).abs().max().item():.2e})"
    )
    assert worst < 1e-4


@pytest.fixture(scope="module")
async def generator(processes, exports):
    folder, _ = exports[2]
    cfg = GeneratorConfig(
        model=str(folder),
        max_model_len=512,
        max_num_seqs=8,
        kv_cache_mb=64,
    )
    sync = WeightSyncConfig(TransportConfig(path=str(folder.parent / "generator_transport")))
    return await Generator.options(env={"OMP_NUM_THREADS": "1"}).as_actor(cfg, sync)


async def test_vllm_serves_the_export_like_transformers(generator, exports):
    folder, _ = exports[2]
    model = hf_model(folder)
    worst = 0.0
    for prompt in PROMPTS:
        (c,) = await generator.generate.call_one(
            prompt, sampling={"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
        )
        assert c.token_ids == hf_greedy(model, c.prompt_ids, 8), prompt
        diff = (torch.tensor(c.logprobs) - hf_logprobs(model, c.prompt_ids, c.token_ids)).abs()
        worst = max(worst, diff.max().item())
    print(f"vLLM vs transformers on the export: max |dlogprob| {worst:.2e}")
    assert worst < 1e-3


def test_export_replaces_a_folder_only_once_the_new_one_is_complete(tmp_path):
    src = source()
    weights = load_file(src / "model.safetensors")
    dest = tmp_path / "out"
    save_hf(weights, src, dest)
    first = load_file(dest / "model.safetensors")

    bumped = {k: v + 1 for k, v in weights.items()}
    bumped["lm_head.weight"] = bumped["model.embed_tokens.weight"]  # tied: not written
    assert save_hf(bumped, src, dest) == dest
    second = load_file(dest / "model.safetensors")
    assert set(second) == set(first)
    assert all(torch.equal(second[k], weights[k] + 1) for k in weights)

    wrong = dict(weights)
    wrong.pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        save_hf(wrong, src, dest)
    # The failed export left the previous folder whole and no temporary folder behind.
    assert all(torch.equal(load_file(dest / "model.safetensors")[k], second[k]) for k in second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
