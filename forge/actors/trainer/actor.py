"""TitanTrainer: a torchtitan model trained with forge's losses, data-parallel over its procs.

    trainer = await TitanTrainer.options(procs=2).as_actor(TrainerConfig(), WeightSyncConfig())
    metrics = await trainer.train_step.call_one(batches)   # batches[r] goes to rank r
    await trainer.push_weights.call(version)               # every rank takes part; rank 0 publishes

Uses torchtitan's models, parallelize functions (FSDP; tensor parallel on GPU) and state-dict
adapters under our own train step: torchtitan's stock Trainer assumes CUDA. The actor holds
the endpoints and composes the parts that do the work (see the package's docstring).
"""

import asyncio
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from monarch.actor import endpoint

from forge.actors.trainer.build import build_model
from forge.actors.trainer.calibrate import calibrate
from forge.actors.trainer.client_steps import AdamStep, ClientSteps, TokenDatum
from forge.actors.trainer.config import TrainerConfig
from forge.actors.trainer.export import export_hf
from forge.actors.trainer.publish import Publisher
from forge.actors.trainer.training import Training
from forge.controller import ForgeActor
from forge.controller.compute_thread import ComputeThread
from forge.data.episode import Episode
from forge.observability.startup import phase
from forge.placement.cores import move_to_cores, process_cores, rank_share
from forge.weights.sync_config import WeightSyncConfig


class TitanTrainer(ForgeActor):
    """Trains a torchtitan model on batches of episodes and publishes its weights.

    Args:
        cfg: the model, its optimisation and objective.
        weight_sync: the run's weight-sync section: the LoRA adapters it trains (if any), and
            what its versions hold and where they go.
    """

    def __init__(
        self, cfg: TrainerConfig | None = None, weight_sync: WeightSyncConfig | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg or TrainerConfig()
        self.weight_sync = weight_sync or WeightSyncConfig()
        self.step = 0
        self._digest: str | None = None  # of the current parameters, once asked for
        # Every tensor op of this actor runs there: one OpenMP pool (see ComputeThread).
        self.compute = ComputeThread("forge-trainer")

    @endpoint
    async def setup(self) -> None:
        """Joins the process group, builds and shards the model, resumes the latest checkpoint."""
        await self.compute.run(self._setup)

    def _setup(self) -> None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
        if cuda:
            torch.cuda.set_device(device)
        with phase("TitanTrainer", "process group"):
            dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(self.cfg.seed + rank)
        with phase("TitanTrainer", "model build"):
            self.model = build_model(self.cfg, self.weight_sync.lora, rank, world, device)
            self.training = Training(self.cfg, self.model)
            self.client_steps = ClientSteps(self.training)
        t = self.training
        with phase("TitanTrainer", "checkpoint resume"):
            # Imported here: torch.distributed.checkpoint is a third of a second to import,
            # which a run's driver, naming this class to spawn it, need not pay.
            from forge.actors.trainer.checkpointing import Checkpointer

            self.checkpointer = Checkpointer(
                self.cfg.checkpoint, self.model.module, t.optimizer, t.scheduler, t.guard
            )
            self.step = self.checkpointer.resume()
        with phase("TitanTrainer", "publisher"):
            self.publisher = Publisher(self.weight_sync, self.model)

    # --- training -----------------------------------------------------------------------------

    @endpoint
    async def train_step(
        self, batches: list[list[Episode]], policy_version: int | None = None, record: bool = False
    ) -> dict[str, Any]:
        """One optimiser step on `batches[rank]` per rank; returns global metrics.

        `policy_version` is the version of the trainer's current weights: episodes of that
        version give the mismatch KL (the engines' disagreement on the same weights), older
        ones the policy drift since. None counts every episode as current. With `record`, the
        metrics also hold "record": what the batch record keeps besides the batch (the
        parameters' digests before and after, the thread count, whether the weights before
        the previous step were kept; forge.loop.record.batches), and "digest_s" the seconds the
        digests took.
        """
        mine = self._mine(batches)
        start = time.perf_counter()
        before = (await self._params_digest()) if record else ""
        digest_s = time.perf_counter() - start
        kept, threads = self.training.mismatch.kept, self.compute.threads
        metrics = await self.compute.run(self.training.step, mine, policy_version)
        self.step += 1
        self._digest = None
        if record:
            start = time.perf_counter()
            after = await self._params_digest()
            metrics["digest_s"] = digest_s + time.perf_counter() - start
            metrics["record"] = {
                "params_before": before,
                "params_after": after,
                "threads": threads,
                "previous_kept": kept,
            }
        return metrics

    @endpoint
    async def params_digest(self) -> str:
        """A digest of the trained parameters (equal digests on as many ranks: bit-identical
        parameters). Call on every rank."""
        return await self._params_digest()

    async def _params_digest(self) -> str:
        if self._digest is None:  # a step or a load drops it
            self._digest = await self.compute.run(self.model.digest)
        return self._digest

    @endpoint
    async def forward_backward(
        self,
        data: list[list[TokenDatum]],
        loss: str,
        config: dict[str, float],
        backward: bool = True,
    ) -> tuple[list[list[float]], list[list[float]], float]:
        """A client-driven pass (the Tinker API's forward / forward_backward) over `data[rank]`
        per rank with built-in loss `loss` (forge.losses.tinker): this rank's data's target
        logprobs and per-token losses, and the loss summed over every rank's. With `backward`
        its gradients are added to those held until `optim_step`. Call on every rank."""
        return await self.compute.run(
            self.client_steps.forward_backward, self._mine(data), loss, config, backward
        )

    @endpoint
    async def optim_step(self, adam: AdamStep) -> dict[str, float]:
        """Applies the gradients `forward_backward` added since the last step (the Tinker
        API's optim_step) and counts a step. Call on every rank."""
        metrics = await self.compute.run(self.client_steps.optim_step, adam)
        self.step += 1
        self._digest = None
        return metrics

    @endpoint
    async def eval_loss(self, batches: list[list[Episode]]) -> float:
        """The objective's loss on `batches[rank]` per rank, without a step: a held-out loss."""
        return await self.compute.run(self.training.eval_loss, self._mine(batches))

    @endpoint
    async def compute_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per-token logprobs of each (prompt ids, completion ids) under the current weights,
        `micro_batch_size` sequences per forward pass. Call on every rank with the same pairs."""
        return await self.compute.run(self.training.logprobs, pairs)

    def _mine(self, batches: list[list[Any]]) -> list[Any]:
        """This rank's batch of `batches`, one per data-parallel rank."""
        if len(batches) != self.model.world:
            raise ValueError(
                f"got {len(batches)} batches for {self.model.world} data-parallel ranks"
            )
        return batches[self.model.rank]

    # --- placement ----------------------------------------------------------------------------

    @endpoint
    async def calibrate(self, batches: list[list[Episode]], micro_batches: int = 3) -> dict:
        """Times `micro_batches` forward and backward passes of `batches[rank]` (and forward
        passes alone), and scales them to the whole batch by padded tokens.

        Returns {"train_s": one step on the batch, "stale_s": what the exact mismatch pass
        adds when the batch is one version old}. Changes no weight and no optimizer state.
        """
        mine = batches[self.model.rank]
        return await self.compute.run(calibrate, self.training, mine, micro_batches)

    @endpoint
    async def use_cores(self, cpus: list[int]) -> list[int]:
        """Moves the trainer onto `cpus`, an equal share to each rank (all of them to every
        rank if there are fewer cores than ranks); compute threads take the new count."""
        mine = rank_share(cpus, self.model.rank, self.model.world)
        self.compute.threads = len(mine)
        return move_to_cores(mine)

    @endpoint
    async def use_threads(self, threads: int) -> None:
        """Runs compute on `threads` threads from the next call (`forge replay` takes a step
        on as many as the run did: CPU kernels may sum in another order on another count)."""
        self.compute.threads = threads

    @endpoint
    async def cores(self) -> dict[str, Any]:
        """Pid, cores, and the thread count its compute runs with."""
        return process_cores(await self.compute.run(torch.get_num_threads))

    # --- weights and checkpoints --------------------------------------------------------------

    @endpoint
    async def push_weights(self, version: int) -> dict[str, float]:
        """Publishes the current weights as `version` (HF names; with LoRA, the adapters in
        PEFT's layout). Call on every rank."""
        return await self.publisher.push(version, self.compute)

    @endpoint
    async def export_hf(self, path: str, merged: bool = False) -> str:
        """Writes the current weights as a Hugging Face folder at `path`; returns `path`.

        Call on every rank (`.call`): gathering the full weights is a collective. Rank 0
        writes the folder (the source checkpoint's config and tokenizer, the trained weights)
        and replaces an existing one only once complete; transformers and vLLM load it as is.
        With LoRA the folder is a PEFT adapter (adapter_config.json, adapter_model.safetensors)
        for the source checkpoint, or with `merged`, the model with its adapters folded in.
        """
        lora = self.weight_sync.lora
        return await self.compute.run(export_hf, self.model, self.cfg.model, lora, path, merged)

    @endpoint
    async def save_checkpoint(self, background: bool | None = None) -> float:
        """Saves model, optimizer, scheduler, step and RNG as checkpoint `step-<step>`.

        In the background (default: the config's `async_save`) it returns once the state is
        staged; the checkpoint becomes `latest` when written. Returns the seconds it blocked.
        """
        return await self.compute.run(self.checkpointer.save, self.step, background)

    @endpoint
    async def load_checkpoint(self, folder: str, step: int, optimizer: bool = True) -> None:
        """Loads checkpoint `step` of `folder` (model, optimizer, scheduler, step, RNG) in place
        of the current state; step 0 is the weights the trainer was built with, untouched.
        Without `optimizer` the optimizer starts afresh (no moments) on the loaded weights.
        Call on every rank: `forge replay` starts from it."""
        if step:
            self.step = await self.compute.run(self.checkpointer.load, folder, step)
            self._digest = None
        if not optimizer:
            self.training.optimizer.state.clear()

    @endpoint
    async def set_optimisation(self, cfg: TrainerConfig) -> None:
        """Takes `cfg`'s loss, optimizer, schedule and gradient clipping from the next step on
        (a what-if of `forge replay`); the rest of `cfg` must equal the trainer's own."""
        await self.compute.run(self.training.set_optimisation, cfg)

    @endpoint
    async def wait_checkpoint(self) -> None:
        """Returns once the last background checkpoint write is complete."""
        await asyncio.to_thread(self.checkpointer.wait)

    @endpoint
    async def get_step(self) -> int:
        """The number of optimiser steps taken (resumed ones included)."""
        return self.step
