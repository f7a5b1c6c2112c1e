"""A training model of the Tinker API (a tenant): LoRA adapters on a base model, trained by a
TitanTrainer of their own and sampled by a Generator of their own, which loads exactly the
versions the client saves for sampling, over forge's weight sync.

A tenant keeps its settings and saved states in its folder (`<state_dir>/models/<model id>/`):
`model.json`, `states.json` (state name -> trainer step) and the trainer's checkpoints, so a
restarted server loads them for a client's `load_weights`.
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.actors.generator import Generator
from forge.actors.trainer import TitanTrainer
from forge.actors.trainer.checkpoint_folder import CheckpointConfig
from forge.actors.trainer.client_steps import AdamStep
from forge.losses.tinker import LOSS_INPUTS, loss_config
from forge.models import resolve_model
from forge.models.lora import LoRAConfig, LoRATarget
from forge.serve.tinker.config import ServeConfig
from forge.serve.tinker.futures import Binary, Futures, SeqOrder, UserError
from forge.serve.tinker.wire import (
    ForwardBackward,
    Sequence,
    forward_backward_output,
    sample_response,
)
from forge.weights.sync_config import WeightSyncConfig
from forge.weights.transport import (
    TransportConfig,
    WeightTransport,
    delete_older_than,
    make_transport,
)

_ATTENTION: list[LoRATarget] = ["q_proj", "k_proj", "v_proj", "o_proj"]
_MLP: list[LoRATarget] = ["gate_proj", "up_proj", "down_proj"]


@dataclass
class ModelSpec:
    """What a training model is: its base, and its adapters' rank, targets and seed."""

    base_model: str
    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    seed: int = 0

    def lora(self, alpha: float) -> LoRAConfig:
        targets = (_ATTENTION if self.train_attn else []) + (_MLP if self.train_mlp else [])
        if not targets:
            raise UserError("lora_config trains neither attention nor MLP: nothing would train")
        return LoRAConfig(rank=self.rank, alpha=alpha, target_modules=targets, publish="adapter")


class Tenant:
    """One training model: its trainer, its sampler engine, its requests in seq_id order."""

    def __init__(
        self,
        model_id: str,
        spec: ModelSpec,
        folder: Path,
        trainer: Any,
        generator: Any,
        sync: WeightSyncConfig,
        order: SeqOrder,
    ) -> None:
        self.model_id = model_id
        self.spec = spec
        self.folder = folder
        self.trainer = trainer
        self.generator = generator
        self.sync = sync
        self.order = order
        self.version = 0  # the version the sampler engine serves (0: the base model)
        self.samplers = 0  # versions saved for sampling so far

    @classmethod
    async def start(
        cls, model_id: str, spec: ModelSpec, cfg: ServeConfig, futures: Futures, shm: Path
    ) -> "Tenant":
        """Spawns the model's trainer and sampler engine; writes its `model.json`."""
        folder = Path(cfg.state_dir) / "models" / model_id
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.json").write_text(json.dumps(dataclasses.asdict(spec)))
        path = str(resolve_model(spec.base_model))
        transport = TransportConfig(kind="shm", path=str(shm / model_id))
        sync = WeightSyncConfig(transport, cfg.dtype, spec.lora(cfg.lora_alpha))
        checkpoint = CheckpointConfig(
            folder=str(folder / "checkpoints"), keep=1 << 30, async_save=False
        )
        trainer_cfg = dataclasses.replace(
            cfg.trainer, model=path, temperature=1.0, seed=spec.seed, checkpoint=checkpoint
        )
        generator_cfg = dataclasses.replace(cfg.generator, model=path)
        trainer = await TitanTrainer.options(procs=1).as_actor(trainer_cfg, sync)
        try:
            generator = await Generator.options(num_replicas=1).as_service(generator_cfg, sync)
        except BaseException:
            await TitanTrainer.shutdown(trainer)
            raise
        order = SeqOrder(futures, cfg.max_pending)
        return cls(model_id, spec, folder, trainer, generator, sync, order)

    async def forward_backward(self, request: ForwardBackward) -> Binary:
        """A forward (no gradients) or forward_backward pass; its logprobs, per-token losses
        and `loss:sum`."""
        config = _checked(request)
        logprobs, losses, total = await self.trainer.forward_backward.call_one(
            [request.data], request.loss_fn, config, not request.forward_only
        )
        return Binary(forward_backward_output(logprobs, losses, {"loss:sum": total}))

    async def optim_step(self, adam: dict[str, Any]) -> dict[str, Any]:
        """Applies the gradients added since the last step with the client's Adam settings."""
        try:
            step = AdamStep(**adam)
        except TypeError as error:
            raise UserError(f"adam_params: {error}") from None
        metrics = await self.trainer.optim_step.call_one(step)
        return {"metrics": {f"{k}:mean": v for k, v in metrics.items()}}

    async def save_for_sampler(self) -> int:
        """Publishes the current adapters as the next version and has the sampler engine
        load it; returns the version."""
        self.samplers += 1
        version = self.samplers
        await self.trainer.push_weights.call(version)
        await self.generator.update_weights.fanout(version)
        self.version = version
        await delete_older_than(_transport(self.sync), version)
        return version

    async def save_state(self, name: str) -> None:
        """Checkpoints the trainer (weights, optimizer, step) under `name` in the folder."""
        await self.trainer.save_checkpoint.call(background=False)
        step = await self.trainer.get_step.call_one()
        states = self.states()
        states[name] = step
        (self.folder / "states.json").write_text(json.dumps(states))

    def states(self) -> dict[str, int]:
        """Saved state name -> the trainer step it holds."""
        path = self.folder / "states.json"
        return json.loads(path.read_text()) if path.exists() else {}

    async def load_state(self, folder: Path, step: int, optimizer: bool) -> None:
        """Loads a saved state of this model or of an earlier one of the same spec."""
        await self.trainer.load_checkpoint.call(str(folder / "checkpoints"), step, optimizer)

    async def sample(
        self, version: int, prompt: list[int], n: int, sampling: dict[str, Any]
    ) -> Binary:
        """`n` sequences from `prompt` on `version`'s weights (the one the engine serves)."""
        self._check_serves(version)
        completions = await self.generator.generate.route(prompt, n=n, sampling=sampling)
        sequences = [
            Sequence(c.token_ids, c.logprobs, c.stop_reason == "stop") for c in completions
        ]
        return Binary(sample_response(sequences, None))

    def _check_serves(self, version: int) -> None:
        if version != self.version:
            raise UserError(
                f"this sampler holds version {version} of {self.model_id}, whose sampler engine "
                f"has moved on to version {self.version}: save weights for a new sampler"
            )

    async def prompt_logprobs(self, version: int, prompt: list[int]) -> Binary:
        """The logprob of each prompt token on `version`'s weights (the SDK's
        compute_logprobs: one sampled token besides, which it ignores)."""
        self._check_serves(version)
        logprobs = await self.generator.prompt_logprobs.route(prompt)
        (first,) = await self.generator.generate.route(prompt, n=1, sampling={"max_tokens": 1})
        sequence = Sequence(first.token_ids, first.logprobs, first.stop_reason == "stop")
        values = [float("nan") if lp is None else lp for lp in logprobs]
        return Binary(sample_response([sequence], values))

    async def close(self) -> None:
        """Stops the trainer and the sampler engine, failing the requests still queued or
        running; their weight versions are removed."""
        self.order.cancel()
        await self.generator.shutdown()
        await TitanTrainer.shutdown(self.trainer)
        await _transport(self.sync).clear()


def _checked(request: ForwardBackward) -> dict[str, float]:
    """The loss's settings, once the request's data holds what the loss reads."""
    if request.problem is not None:
        raise UserError(request.problem)
    config = loss_config(request.loss_fn, request.loss_fn_config)
    if not request.data:
        raise UserError("forward_backward with no data")
    wanted = {"target_tokens", *LOSS_INPUTS[request.loss_fn]}
    for i, datum in enumerate(request.data):
        if missing := sorted(wanted - set(datum.inputs)):
            raise UserError(
                f"datum {i}: loss_fn {request.loss_fn!r} needs loss_fn_inputs {missing}"
            )
        datum.inputs = {name: datum.inputs[name] for name in wanted}
    return config


def _transport(sync: WeightSyncConfig) -> WeightTransport:
    return make_transport(sync.transport)
