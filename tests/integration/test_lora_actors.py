"""LoRA end to end on real processes and a real vLLM engine, with a tiny Llama: the trainer
trains and checkpoints the adapters alone, publishes them in PEFT's layout, a generator serves
them in each update mode (and refuses a corrupted one), and PEFT loads the export."""

import os
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from monarch.actor import ActorError
from peft import PeftModel
from test_trainer import episodes, on_policy, sync_config, trainer_config
from transformers import AutoModelForCausalLM

from forge.actors.generator import Generator, GeneratorConfig
from forge.actors.trainer import OptimizerConfig, TitanTrainer, TrainerConfig
from forge.actors.trainer.checkpoint_folder import CheckpointConfig, step_folder
from forge.controller import shutdown
from forge.losses import mismatch_kl
from forge.models.lora import LoRAConfig
from forge.weights.shm_transport import SharedMemoryTransport
from forge.weights.sync_config import WeightSyncConfig

pytestmark = pytest.mark.integration

LORA = LoRAConfig(rank=4, alpha=8.0)


def lora_trainer(tmp_path, **changes) -> TrainerConfig:
    # A large lr: the adapters' first steps move the outputs far above float noise.
    return trainer_config(tmp_path, optimizer=OptimizerConfig(lr=1e-2), **changes)


def lora_sync(tmp_path, name: str = "w", lora: LoRAConfig = LORA) -> WeightSyncConfig:
    """The adapters `lora` trained, published into tmp_path / name and served from there."""
    return sync_config(tmp_path, name, lora=lora)


async def generator_vs_trainer(generator, trainer) -> tuple[float, list]:
    """The mismatch KL of 4 sampled completions' logprobs, generator against trainer, and the
    completions."""
    sampling = {"max_tokens": 16}
    completions = await generator.generate.call_one("Count: 1 2 3", n=4, sampling=sampling)
    pairs = [(c.prompt_ids, c.token_ids) for c in completions]
    trainer_lp = await trainer.compute_logprobs.call_one(pairs)
    gen = torch.tensor([lp for c in completions for lp in c.logprobs])
    ours = torch.tensor([lp for row in trainer_lp for lp in row])
    kl, _ = mismatch_kl(ours, gen, torch.ones_like(gen, dtype=torch.bool))
    return kl, completions


@pytest.fixture
async def cleanup():
    yield
    await shutdown()


async def test_the_adapters_alone_train_publish_and_checkpoint_and_resume(tmp_path, cleanup):
    folder = tmp_path / "ckpt"
    cfg = lora_trainer(tmp_path, checkpoint=CheckpointConfig(folder=str(folder)))
    trainer = await TitanTrainer.as_actor(cfg, lora_sync(tmp_path))
    transport = SharedMemoryTransport(tmp_path / "w")
    await trainer.push_weights.call_one(0)
    start = await transport.fetch(0)
    assert start and all(".lora_A." in k or ".lora_B." in k for k in start)
    assert all(not v.any() for k, v in start.items() if ".lora_B." in k)

    b1, b2, b3 = episodes(seed=1), episodes(seed=2), episodes(seed=3)
    await trainer.train_step.call_one([b1])
    await trainer.train_step.call_one([b2])
    pushed = await trainer.push_weights.call_one(2)
    after = await transport.fetch(2)
    assert all(after[k].any() for k in after if ".lora_B." in k)
    print(f"a LoRA version: {pushed['bytes']} bytes")

    await trainer.save_checkpoint.call_one()
    uninterrupted = (await trainer.train_step.call_one([b3]))["loss"]
    await trainer.wait_checkpoint.call_one()
    saved = dcp.FileSystemReader(str(step_folder(folder, 2))).read_metadata()
    model_keys = [k for k in saved.state_dict_metadata if k.startswith("train.model.")]
    optim_keys = [k for k in saved.state_dict_metadata if k.startswith("train.optim.state.")]
    assert model_keys and all(".lora_" in k for k in model_keys + optim_keys), model_keys[:3]
    os.kill(await trainer.ping.call_one(), signal.SIGKILL)

    resumed = await TitanTrainer.as_actor(cfg, lora_sync(tmp_path))
    assert await resumed.get_step.call_one() == 2
    assert (await resumed.train_step.call_one([b3]))["loss"] == pytest.approx(uninterrupted, abs=0)


async def test_lora_over_two_processes_equals_one_process(tmp_path, cleanup):
    cfg = lora_trainer(tmp_path)
    one = await TitanTrainer.options(procs=1).as_actor(cfg, lora_sync(tmp_path, "one"))
    two = await TitanTrainer.options(procs=2).as_actor(cfg, lora_sync(tmp_path, "two"))
    batch = await on_policy(one, episodes(8))
    m1 = await one.train_step.call_one([batch])
    m2 = (await two.train_step.call([batch[:4], batch[4:]])).item(procs=0)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-5)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    await one.push_weights.call_one(1)
    await two.push_weights.call(1)
    w1 = await SharedMemoryTransport(tmp_path / "one").fetch(1)
    w2 = await SharedMemoryTransport(tmp_path / "two").fetch(1)
    assert list(w1) == list(w2)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5


async def test_the_generator_serves_each_adapter_version_in_every_mode(tmp_path, cleanup):
    cfg, sync = lora_trainer(tmp_path), lora_sync(tmp_path)
    trainer = await TitanTrainer.as_actor(cfg, sync)
    generator = await Generator.options(env={"OMP_NUM_THREADS": "1"}).as_actor(
        GeneratorConfig(model=cfg.model, max_model_len=256, kv_cache_mb=32), sync
    )
    for version, mode in enumerate(["drain", "abort", "inflight"], start=1):
        await trainer.train_step.call_one([episodes(seed=version)])
        await trainer.push_weights.call_one(version)
        update = await generator.update_weights.call_one(version, mode)
        assert update["mode"] == mode
        kl, completions = await generator_vs_trainer(generator, trainer)
        assert all(c.token_versions == [version] * len(c.token_ids) for c in completions)
        print(f"v{version} ({mode}): trainer vs generator mismatch KL {kl:.2e}")
        assert kl < 1e-3

    greedy = {"max_tokens": 8, "temperature": 0.0}
    (before,) = await generator.generate.call_one("Once upon a time", sampling=greedy)
    await trainer.train_step.call_one([episodes(seed=9)])
    await trainer.push_weights.call_one(4)
    blob = SharedMemoryTransport(tmp_path / "w")._dir(4) / "tensors.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x10
    blob.write_bytes(bytes(data))
    with pytest.raises(ActorError, match="checksum mismatch.*stays on version 3"):
        await generator.update_weights.call_one(4)
    assert await generator.get_version.call_one() == 3
    (after,) = await generator.generate.call_one("Once upon a time", sampling=greedy)
    assert after.token_ids == before.token_ids and after.token_versions == [3] * 8

    # A version number again (as a calibration's scratch sync goes back to the run's version),
    # then on: each is served, and the generator's old folders are removed without error.
    for version in (2, 4, 5):
        await trainer.push_weights.call_one(version)
        await generator.update_weights.call_one(version)
        kl, completions = await generator_vs_trainer(generator, trainer)
        assert all(c.token_versions == [version] * len(c.token_ids) for c in completions)
        assert kl < 1e-3


async def test_merged_versions_are_served_as_a_plain_model(tmp_path, cleanup):
    """`lora.publish: merged`: each version is the full weights with the adapters folded in;
    the generator serves them without LoRA and agrees with the trainer."""
    merged = LoRAConfig(rank=4, alpha=8.0, publish="merged")
    cfg, sync = lora_trainer(tmp_path), lora_sync(tmp_path, lora=merged)
    trainer = await TitanTrainer.as_actor(cfg, sync)
    generator = await Generator.options(env={"OMP_NUM_THREADS": "1"}).as_actor(
        GeneratorConfig(model=cfg.model, max_model_len=256, kv_cache_mb=32), sync
    )
    await trainer.train_step.call_one([episodes(seed=1)])
    pushed = await trainer.push_weights.call_one(1)
    assert pushed["bytes"] > 20e6  # the whole tiny model, its embedding most of it
    await generator.update_weights.call_one(1)
    kl, _ = await generator_vs_trainer(generator, trainer)
    print(f"merged version: trainer vs generator mismatch KL {kl:.2e}")
    assert kl < 1e-3


async def test_peft_loads_the_exported_adapter_and_scores_like_the_trainer(tmp_path, cleanup):
    cfg = lora_trainer(tmp_path)
    trainer = await TitanTrainer.as_actor(cfg, lora_sync(tmp_path))
    for seed in (1, 2):
        await trainer.train_step.call_one([episodes(seed=seed)])
    adapter = await trainer.export_hf.call_one(str(tmp_path / "adapter"))
    merged = await trainer.export_hf.call_one(str(tmp_path / "merged"), merged=True)
    pairs = [(e.completion.prompt_ids, e.completion.token_ids) for e in episodes(4, seed=7)]
    ours = torch.cat([torch.tensor(r) for r in await trainer.compute_logprobs.call_one(pairs)])

    base = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    models = {
        "PEFT adapter": PeftModel.from_pretrained(base, adapter).eval(),
        "merged": AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval(),
    }
    for name, model in models.items():
        theirs = torch.cat([hf_logprobs(model, p, t) for p, t in pairs])
        print(f"{name} vs trainer: max |dlogprob| {(theirs - ours).abs().max():.2e}")
        # Logprobs reach -30 with this peaked model: float32 rounding is relative to them.
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-4, msg=name)


def hf_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    return logprobs.gather(-1, targets[:, None])[len(prompt_ids) - 1 :, 0]
