"""TitanTrainer: a torchtitan model trained with forge's losses, data-parallel over its procs.

    trainer = await TitanTrainer.options(procs=2).as_actor(TrainerConfig())
    metrics = await trainer.train_step.call_one(batches)   # batches[r] goes to rank r
    await trainer.push_weights.call(version)               # every rank takes part; rank 0 publishes

Uses torchtitan's models, parallelize functions (FSDP; tensor parallel on GPU) and state-dict
adapters under our own train step: torchtitan's stock Trainer assumes CUDA. Losses are
normalised by the global token (or sequence) count, and FSDP sums gradients, so N processes
compute exactly what one process computes on the whole batch.
"""

import asyncio
import contextlib
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from monarch.actor import endpoint

from forge.actors.checkpointing import CheckpointConfig, Checkpointer
from forge.controller import ForgeActor
from forge.controller.compute_thread import ComputeThread
from forge.controller.placement import pin_to_cores
from forge.data.collate import Batch, collate, first_position, gather_tokens, pad_sequences
from forge.data.episode import Episode
from forge.losses import OBJECTIVES, GRPOConfig, ObjectiveInputs, ObjectiveName, kl_k3, masked_sum
from forge.models import resolve_model
from forge.models.hf_layout import HfLayout
from forge.models.lora import (
    LoRAConfig,
    PeftLayout,
    add_dropout,
    initial_adapters,
    is_adapter,
    merge,
    peft_config,
    with_lora,
)
from forge.models.titan import (
    LOGITS_CHUNK_TOKENS,
    build,
    candidate_logprobs,
    hf_state_dict,
    titan_model,
    token_logprobs,
)
from forge.models.titan_compat import force_sum_reduction, use_device_type
from forge.observability.memory import PeakMemory
from forge.weights.transport import TransportConfig, make_transport

# The parts of the generator-vs-trainer KL a step sums over micro-batches, then over ranks.
KL_PARTS = (
    "tokens", "current", "current_kl", "older_kl", "previous", "previous_kl",
    "previous_sequences", "previous_sampled",
)  # fmt: skip


@dataclass
class OptimizerConfig:
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class SchedulerConfig:
    """Linear warm-up over `warmup_steps`, then `decay` to lr * min_lr_ratio over `decay_steps`."""

    warmup_steps: int = 0
    decay: Literal["constant", "linear", "cosine"] = "constant"
    decay_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class TrainerConfig:
    """The model, its optimisation, its objective, and where its weights go.

    Args:
        objective: a name in forge.losses.OBJECTIVES: "grpo" (policy gradient on
            advantages), "distill" (reverse KL to teacher_logprobs) or "sft" (cross-entropy on
            the completion tokens).
        temperature: the generator's sampling temperature; logprobs are taken at it.
        dtype: "float32", or "bfloat16" compute over float32 weights, gradients and optimizer
            state: FSDP's mixed precision on GPUs, autocast on CPUs (where FSDP's per-unshard
            casts made a step slower than float32).
        publish_dtype: the dtype published versions hold: the generators' (a run sets it to
            generator.dtype), so a bfloat16 engine gets half the bytes, already rounded as its
            loader would round them. None: the parameters' own.
        tensor_parallel: tensor-parallel degree (GPU); the data-parallel degree is the rest.
        exact_mismatch: keep a copy of the weights before each step, so one-version-old
            episodes can be scored under the weights that generated them.
        exact_mismatch_sample: the fraction of one-version-old sequences scored so (at least
            one): a forward pass of them, plus swapping the weights in and out. The default
            keeps it near 5% of a step's time; 1.0 scores them all.
        micro_batch_size: sequences per forward and backward pass on a rank; gradients
            accumulate over a rank's batch, so the step equals one pass over it. 0: the whole
            batch at once. Bounds activation memory.
        logits_chunk_tokens: tokens (sequences x positions) whose vocabulary logits exist at
            once; logits are recomputed in the backward pass. Bounds logit memory.
        activation_checkpointing: "full" recomputes each transformer block in the backward
            pass instead of keeping its activations (torchtitan's full AC): less memory for
            about a third more compute.
        lora: train LoRA adapters on the frozen model instead of the model itself
            (forge.models.lora): only adapters hold gradients and optimizer state, checkpoints
            hold them alone, and each published version is the adapters in PEFT's layout (or,
            with `lora.publish: merged`, the weights with them folded in). None: full
            fine-tuning.
    """

    model: str = "SmolLM2-135M-Instruct"
    objective: ObjectiveName = "grpo"
    temperature: float = 1.0
    dtype: Literal["float32", "bfloat16"] = "float32"
    publish_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    max_grad_norm: float = 1.0
    tensor_parallel: int = 1
    seed: int = 0
    exact_mismatch: bool = True  # keep the previous weights to measure the mismatch KL exactly
    exact_mismatch_sample: float = 0.05
    micro_batch_size: int = 0
    logits_chunk_tokens: int = LOGITS_CHUNK_TOKENS
    activation_checkpointing: Literal["none", "full"] = "none"
    lora: LoRAConfig | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    loss: GRPOConfig = field(default_factory=GRPOConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        # Literal fields are checked by the config loader; this guards direct construction.
        if self.objective not in OBJECTIVES:
            known = sorted(OBJECTIVES)
            raise ValueError(f"objective must be one of {known}, got {self.objective!r}")
        if not 0.0 < self.exact_mismatch_sample <= 1.0:
            raise ValueError(
                f"exact_mismatch_sample must be in (0, 1], got {self.exact_mismatch_sample}"
            )
        if self.micro_batch_size < 0 or self.logits_chunk_tokens < 1:
            raise ValueError(
                "need micro_batch_size >= 0 and logits_chunk_tokens >= 1, got "
                f"{self.micro_batch_size} and {self.logits_chunk_tokens}"
            )


class TitanTrainer(ForgeActor):
    """Trains a torchtitan model on batches of episodes and publishes its weights."""

    def __init__(self, cfg: TrainerConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or TrainerConfig()
        self.step = 0
        self._previous: tuple[int, list[torch.Tensor]] | None = None  # version, weights
        self._hf_layout: Callable[[dict], dict] | None = None  # learned at the first use
        self._peft_layout: PeftLayout | None = None  # with LoRA: learned at setup, on rank 0
        # Every tensor op of this actor runs there: one OpenMP pool (see ComputeThread).
        self.compute = ComputeThread("forge-trainer")

    @endpoint
    async def setup(self) -> None:
        """Joins the process group, builds and shards the model, resumes the latest checkpoint."""
        await self.compute.run(self._setup)

    def _setup(self) -> None:
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
        if cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(self.cfg.seed + self.rank)
        path = resolve_model(self.cfg.model)
        self.titan = titan_model(path)
        lora = self.cfg.lora
        if lora is not None:
            self.titan = with_lora(self.titan, lora)
        self.model = self._parallelize(self.titan, cuda)
        bf16_on_cpu = not cuda and self.cfg.dtype == "bfloat16"
        self._precision = partial(torch.autocast, "cpu", torch.bfloat16, enabled=bf16_on_cpu)
        weights = self.titan.adapter.from_hf(hf_state_dict(path))
        if lora is not None:
            weights.update(initial_adapters(self.model, self.cfg.seed))
            add_dropout(self.model, lora.dropout)
        _load_full(self.model, weights)
        if lora is not None:
            self._learn_peft_layout()
        o = self.cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self._trained_parameters(),
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=True,  # one kernel per step instead of a loop over parameters (CPU and GPU)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(self.cfg.scheduler, step)
        )
        self.checkpointer = Checkpointer(
            self.cfg.checkpoint, self.model, self.optimizer, self.scheduler
        )
        self.step = self.checkpointer.resume()
        self.transport = make_transport(self.cfg.transport)
        self.pad_id = 0

    def _parallelize(self, titan: Any, cuda: bool) -> torch.nn.Module:
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.activation_checkpoint import FullAC
        from torchtitan.models.llama3 import parallelize_llama
        from torchtitan.models.qwen3 import parallelize_qwen3

        ac = FullAC.Config() if self.cfg.activation_checkpointing == "full" else None
        if self.world == 1 and (self.cfg.dtype == "float32" or not cuda):
            # One rank has nothing to shard, and on a CPU autocast mixes the precision: FSDP
            # would only copy each parameter at every unshard and keep a second, unsharded
            # gradient while micro-batches accumulate (0.5 GB more at SmolLM2's size).
            model = build(titan, meta=True)
            if ac is not None:
                ac.build(dump_folder="/tmp").apply(model)
            return self._materialise(model)
        use_device_type("cuda" if cuda else "cpu")
        dist_utils.set_spmd_backend("partial_dtensor")
        tp = self.cfg.tensor_parallel
        parallelism = ParallelismConfig(
            data_parallel_shard_degree=self.world // tp,
            tensor_parallel_degree=tp,
            spmd_backend="partial_dtensor",
        )
        dims = ParallelDims.from_config(parallelism, self.world)
        dims.build_mesh()
        parallelize = parallelize_llama if titan.family == "llama" else parallelize_qwen3
        model = parallelize(
            build(titan, meta=True),
            parallel_dims=dims,
            training=TrainingConfig(
                mixed_precision_param=self.cfg.dtype if cuda else "float32",
                mixed_precision_reduce="float32",
            ),
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=ac,
            dump_folder="/tmp",
        )
        if not cuda:
            force_sum_reduction(model)
        return self._materialise(model)

    def _materialise(self, model: torch.nn.Module) -> torch.nn.Module:
        """Allocates a meta-device model's storage and fills its buffers (RoPE cache)."""
        model.to_empty(device=self.device or "cpu")
        with torch.no_grad():
            model.init_states(buffer_device=self.device or torch.device("cpu"))
        return model

    # --- training -----------------------------------------------------------------------------

    @endpoint
    async def train_step(
        self, batches: list[list[Episode]], policy_version: int | None = None
    ) -> dict[str, float]:
        """One optimiser step on `batches[rank]` per rank; returns global metrics.

        `policy_version` is the version of the trainer's current weights: episodes of that
        version give the mismatch KL (the engines' disagreement on the same weights), older
        ones the policy drift since. None counts every episode as current.
        """
        if len(batches) != self.world:
            raise ValueError(f"got {len(batches)} batches for {self.world} data-parallel ranks")
        return await self.compute.run(self._train_step, batches[self.rank], policy_version)

    @endpoint
    async def use_cores(self, cpus: list[int]) -> list[int]:
        """Moves the trainer onto `cpus`, an equal share to each rank (all of them to every
        rank if there are fewer cores than ranks); compute threads take the new count."""
        share = len(cpus) // self.world
        mine = cpus[self.rank * share : (self.rank + 1) * share] if share else cpus
        pin_to_cores(mine)
        self.compute.threads = len(mine)
        return sorted(os.sched_getaffinity(0))

    @endpoint
    async def cores(self) -> dict[str, Any]:
        """Pid, cores, and the thread count its compute runs with."""
        threads = await self.compute.run(torch.get_num_threads)
        return {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)), "threads": threads}

    @endpoint
    async def calibrate(self, batches: list[list[Episode]], micro_batches: int = 3) -> dict:
        """Times `micro_batches` forward and backward passes of `batches[rank]` (and forward
        passes alone), and scales them to the whole batch by padded tokens.

        Returns {"train_s": one step on the batch, "stale_s": what the exact mismatch pass
        adds when the batch is one version old}. Changes no weight and no optimizer state.
        """
        return await self.compute.run(self._calibrate, batches[self.rank], micro_batches)

    def _calibrate(self, episodes: list[Episode], count: int) -> dict[str, float]:
        self.model.train()
        micro = [collate(chunk, self.pad_id) for chunk, _ in self._micro_batches(episodes)]
        tokens = [b.input_ids.numel() for b in micro]
        # Spread over the length-sorted micro-batches.
        picked = sorted({round(i * (len(micro) - 1) / max(count - 1, 1)) for i in range(count)})
        # Untimed first, the longest first: the timed passes then find the heap grown to a
        # step's size, as a run's steps do (growing it faults pages in).
        for i in reversed(picked):
            self._forward(micro[i])[1].backward()
        # Then as a step starts: no gradients.
        self.optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for i in picked:
            self._forward(micro[i])[1].backward()
        backward = time.perf_counter() - start
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self._trained_parameters(), self.cfg.max_grad_norm)
        with torch.no_grad():
            copies = [p.detach().clone() for p in self._trained_parameters()]
        # The step's own passes over every parameter: clip, clone, fused AdamW (about two).
        per_step = (time.perf_counter() - start) * 3
        self.optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with torch.no_grad():
            for i in picked:
                self._forward(micro[i])
            forward = time.perf_counter() - start
            start = time.perf_counter()
            with self._weights(copies):  # the exact mismatch pass swaps weights in and out
                pass
            swap = time.perf_counter() - start
        del copies
        scale = _all_max(sum(tokens) / sum(tokens[i] for i in picked))
        # A stale batch: the sampled share of its sequences forward, under swapped weights.
        sampled = math.ceil(len(episodes) * self.cfg.exact_mismatch_sample) / len(episodes)
        return {
            "train_s": _all_max(backward) * scale + _all_max(per_step),
            "stale_s": _all_max(forward) * scale * sampled + _all_max(swap),
        }

    def _train_step(self, episodes: list[Episode], policy_version: int | None) -> dict[str, float]:
        start, started_at = time.perf_counter(), time.time()
        peak = PeakMemory(self.device)
        self.model.train()
        micro = [
            (collate(chunk, self.pad_id), real) for chunk, real in self._micro_batches(episodes)
        ]
        norms = [self._normaliser(batch) if real else 0.0 for batch, real in micro]
        global_norm = max(_all_sum(sum(norms)), 1.0)
        # SFT targets come from data, not from a generator: there is nothing to compare with.
        sampled = self.cfg.objective != "sft"
        sums: dict[str, float] = defaultdict(float)  # loss and metrics, weighted by norm
        kl = dict.fromkeys(KL_PARTS, 0.0)  # generator-vs-trainer KL parts
        if sampled and self._previous is not None:
            # First, while no activation or gradient is held: it adds nothing to the peak.
            self._kl_previous(episodes, kl)
        for i, ((batch, _), norm) in enumerate(zip(micro, norms, strict=True)):
            self._sync_gradients(last=i == len(micro) - 1)
            logprobs, loss, metrics = self._forward(batch)
            (loss * norm / global_norm).backward()
            for name, value in {"loss": loss.detach(), **metrics}.items():
                sums[name] += float(value) * norm
            if sampled and norm:
                self._kl_parts(logprobs.detach(), batch, policy_version, kl)
        mismatch = self._mismatch(kl) if sampled else {}
        # Before the optimiser step: these weights generated the episodes of `policy_version`.
        if sampled and policy_version is not None and self.cfg.exact_mismatch:
            weights = [p.detach().clone() for p in self._trained_parameters()]
            self._previous = (policy_version, weights)
        grad_norm = self._clip_and_step()
        sums["tokens"] = sum(float((b.input_ids != self.pad_id).sum()) for b, real in micro if real)
        totals = _all_sum_each(sums)
        self.step += 1
        return {
            **{name: value / global_norm for name, value in totals.items() if name != "tokens"},
            "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
            "tokens": totals["tokens"],
            "tokens_per_s": totals["tokens"] / (time.perf_counter() - start),
            f"{peak.metric}": _all_max(peak.gb()),
            **mismatch,
            "started_at": started_at,  # wall clock: the run's timeline
            "ended_at": time.time(),
        }

    def _micro_batches(self, episodes: list[Episode]) -> list[tuple[list[Episode], bool]]:
        """This rank's episodes in chunks of `micro_batch_size`, each with whether it is real.

        Sorted by length first. Every rank runs as many chunks as the rank with the most, so
        FSDP's collectives pair up; a rank with fewer fills in with one of its episodes at
        weight 0 (real=False).
        """
        size = self.cfg.micro_batch_size or max(len(episodes), 1)
        count = int(_all_max(math.ceil(len(episodes) / size)))
        # Similar lengths together: each micro-batch pads to its longest sequence.
        episodes = sorted(episodes, key=_length)
        chunks = [episodes[i * size : (i + 1) * size] for i in range(count)]
        return [(chunk or episodes[:1], bool(chunk)) for chunk in chunks]

    def _sync_gradients(self, last: bool) -> None:
        """FSDP reduces gradients after the last micro-batch only; before, it accumulates."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(last)

    def _forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """This micro-batch's per-token logprobs, its loss (normalised by its own `_normaliser`)
        and the objective's metrics."""
        input_ids = self._to_device(batch.input_ids)
        chunk, temperature = self.cfg.logits_chunk_tokens, self.cfg.temperature
        top = None
        first = first_position(batch.mask)
        with self._precision():
            if batch.teacher_top_ids is None:
                logprobs = token_logprobs(self.model, input_ids, temperature, chunk, first)
            else:
                candidates = self._to_device(batch.teacher_top_ids)
                logprobs, top = candidate_logprobs(
                    self.model, input_ids, candidates, temperature, chunk, first
                )
        loss, metrics = self._loss(logprobs, batch, top)
        return logprobs, loss, metrics

    def _kl_parts(self, logprobs, batch: Batch, version: int | None, kl: dict) -> None:
        """Adds this micro-batch's token counts and per-token KL(generator || trainer) sums:
        over tokens sampled by the current weights, and over older ones (policy drift)."""
        mask = self._to_device(batch.mask)
        per_token = kl_k3(self._to_device(batch.behaviour_logprobs), logprobs)
        versions = torch.tensor([-1 if v is None else v for v in batch.policy_versions])
        is_current = (
            torch.ones_like(versions, dtype=torch.bool)
            if version is None
            else (versions == version)
        )
        current = self._to_device(is_current)[:, None] & mask
        older = mask & ~current
        kl["tokens"] += float(mask.sum())
        kl["current"] += float(current.sum())
        kl["current_kl"] += float(masked_sum(per_token, current))
        kl["older_kl"] += float(masked_sum(per_token, older))

    def _mismatch(self, kl: dict[str, float]) -> dict[str, float]:
        """KL(generator || trainer) on the same tokens under the same weights ("mismatch_kl").

        Tokens of the current version use this step's logprobs. Tokens one version old use
        logprobs under the weights before the last step (`exact_mismatch` keeps a copy; a
        sample of those sequences, their share in "mismatch_previous_sampled"), so async
        training still measures the engines' disagreement alone; "policy_drift_kl" is the
        KL of older tokens to the current weights. A part with no tokens is left out.
        """
        t = _all_sum_each(kl)
        out = {"current_token_fraction": t["current"] / max(t["tokens"], 1.0)}
        scored = t["current"] + t["previous"]
        if scored:
            out["mismatch_kl"] = (t["current_kl"] + t["previous_kl"]) / scored
        if t["tokens"] > t["current"]:
            out["policy_drift_kl"] = t["older_kl"] / (t["tokens"] - t["current"])
        if t["previous_sequences"]:  # the share of one-version-old sequences in mismatch_kl
            out["mismatch_previous_sampled"] = t["previous_sampled"] / t["previous_sequences"]
        return out

    def _kl_previous(self, episodes: list[Episode], kl: dict[str, float]) -> None:
        """Adds the KL of a sample of the sequences the previous weights sampled, under those
        weights: `exact_mismatch_sample` of them (at least one), spread over their lengths.

        One forward pass per `micro_batch_size` of the sample; every rank runs as many as the
        rank with the most (fillers at weight 0), since FSDP's gathers pair up.
        """
        version, weights = self._previous
        older = sorted((e for e in episodes if e.policy_version == version), key=_length)
        kl["previous_sequences"] += len(older)
        take = math.ceil(len(older) * self.cfg.exact_mismatch_sample)
        sample = [older[i * len(older) // take] for i in range(take)] if take else []
        size = self.cfg.micro_batch_size or max(len(sample), 1)
        chunks = int(_all_max(math.ceil(len(sample) / size)))
        if not chunks:
            return  # every rank skips the forward passes alike
        kl["previous_sampled"] += len(sample)
        with torch.no_grad(), self._weights(weights), self._precision():
            for i in range(chunks):
                chunk = sample[i * size : (i + 1) * size]
                batch = collate(chunk or episodes[:1], self.pad_id)
                part = self._to_device(batch.mask) & bool(chunk)
                before = token_logprobs(
                    self.model,
                    self._to_device(batch.input_ids),
                    self.cfg.temperature,
                    self.cfg.logits_chunk_tokens,
                    first_position(batch.mask),
                )
                behaviour = self._to_device(batch.behaviour_logprobs)
                kl["previous"] += float(part.sum())
                kl["previous_kl"] += float(masked_sum(kl_k3(behaviour, before), part))

    @contextlib.contextmanager
    def _weights(self, snapshot: list[torch.Tensor]) -> Iterator[None]:
        """Runs the block on `snapshot`'s parameter values, then puts the current ones back
        (`snapshot` holds them meanwhile).

        A plain module's parameters are pointed at the snapshot's storage; FSDP's values are
        swapped in place, one tensor of scratch at a time: a second copy of the whole model
        would raise the step's peak.
        """
        self._swap(snapshot)
        try:
            yield
        finally:
            self._swap(snapshot)

    def _swap(self, snapshot: list[torch.Tensor]) -> None:
        from torch.distributed.fsdp import FSDPModule

        params = self._trained_parameters()
        if not isinstance(self.model, FSDPModule):
            # A plain module's parameters can point at other storage: nothing is copied.
            for i, param in enumerate(params):
                param.data, snapshot[i] = snapshot[i], param.data
            return
        # FSDP keeps its own views of the sharded storage: the values move instead.
        for param, other in zip(params, snapshot, strict=True):
            param = param.detach()
            scratch = param.clone()
            param.copy_(other)
            other.copy_(scratch)

    def _trained_parameters(self) -> list[torch.Tensor]:
        """The parameters the optimizer changes (with LoRA, the adapters), in their sharded
        form: FSDP may leave a module unsharded after a forward pass, and a copy must see the
        same tensors every time."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return [p for p in self.model.parameters() if p.requires_grad]

    def _loss(
        self, logprobs: torch.Tensor, batch: Batch, top: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The objective's loss over a micro-batch (normalised by `_normaliser`) and its
        metrics. `top`: the trainer's logprobs of the teacher's top k tokens, or None."""
        inputs = ObjectiveInputs(
            logprobs=logprobs,
            mask=self._to_device(batch.mask),
            behaviour_logprobs=self._to_device(batch.behaviour_logprobs),
            advantages=self._to_device(batch.advantages),
            ref_logprobs=self._optional(batch.ref_logprobs),
            teacher_logprobs=self._optional(batch.teacher_logprobs),
            teacher_top_logprobs=self._optional(batch.teacher_top_logprobs),
            student_top_logprobs=top,
        )
        return OBJECTIVES[self.cfg.objective](inputs, self.cfg.loss)

    def _normaliser(self, batch: Batch) -> float:
        """What the loss of `batch` is an average over: its completion tokens (token_mean) or
        its non-empty sequences. Weighting each micro-batch's loss by it, over the global sum,
        gives the loss of the whole batch."""
        if self.cfg.loss.aggregation == "token_mean":
            return float(batch.mask.sum())
        return float(batch.mask.any(-1).sum())

    def _optional(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else self._to_device(tensor)

    def _clip_and_step(self) -> torch.Tensor:
        from torchtitan.distributed import utils as dist_utils

        grad_norm = dist_utils.clip_grad_norm_(self._trained_parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device is None else tensor.to(self.device)

    @endpoint
    async def eval_loss(self, batches: list[list[Episode]]) -> float:
        """The objective's loss on `batches[rank]` per rank, without a step: a held-out loss."""
        if len(batches) != self.world:
            raise ValueError(f"got {len(batches)} batches for {self.world} data-parallel ranks")
        return await self.compute.run(self._eval_loss, batches[self.rank])

    def _eval_loss(self, episodes: list[Episode]) -> float:
        self.model.eval()
        total = norm = 0.0
        with torch.no_grad():
            for chunk, real in self._micro_batches(episodes):
                batch = collate(chunk, self.pad_id)
                _, loss, _ = self._forward(batch)
                weight = self._normaliser(batch) if real else 0.0
                total, norm = total + float(loss) * weight, norm + weight
        return _all_sum(total) / max(_all_sum(norm), 1.0)

    @endpoint
    async def compute_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per-token logprobs of each (prompt ids, completion ids) under the current weights,
        `micro_batch_size` sequences per forward pass. Call on every rank with the same pairs."""
        return await self.compute.run(self._compute_logprobs, pairs)

    def _compute_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        self.model.eval()
        size = self.cfg.micro_batch_size or max(len(pairs), 1)
        out: list[list[float]] = []
        for start in range(0, len(pairs), size):
            input_ids, mask = pad_sequences(pairs[start : start + size], self.pad_id)
            with torch.no_grad(), self._precision():
                logprobs = token_logprobs(
                    self.model,
                    self._to_device(input_ids),
                    self.cfg.temperature,
                    self.cfg.logits_chunk_tokens,
                    first_position(mask),
                )
            out.extend(gather_tokens(logprobs.cpu(), mask))
        return out

    # --- weights and checkpoints --------------------------------------------------------------

    @endpoint
    async def push_weights(self, version: int) -> dict[str, float]:
        """Publishes the current weights as `version` (HF names; with LoRA, the adapters in
        PEFT's layout). Call on every rank."""
        start = time.perf_counter()
        state_dict = await self.compute.run(self._hf_state_dict)
        gathered = time.perf_counter()
        if state_dict is None:
            return {"gather_s": gathered - start}
        manifest = await self.transport.publish(version, state_dict)
        return {
            "gather_s": gathered - start,
            "publish_s": time.perf_counter() - gathered,
            "bytes": manifest.total_bytes,
        }

    def _hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """What a version holds, on rank 0 (None on the other ranks): the full weights
        HF-named, or with LoRA the adapters PEFT-named (or with `lora.publish: merged`, the
        weights with the adapters folded in), in `publish_dtype`. Reordered tensors live in
        buffers that the next call overwrites."""
        lora = self.cfg.lora
        if lora is not None and lora.publish == "adapter":
            adapters = self._full_state_dict(adapters_only=True)
            if self.rank != 0:
                return None
            return _in_dtype(self._peft_layout(adapters), self.cfg.publish_dtype)
        state_dict = self._full_state_dict()
        if self.rank != 0:
            return None
        if lora is not None:
            state_dict = merge(state_dict, lora)
        if self._hf_layout is None:
            self._hf_layout = HfLayout.learn(self.titan.adapter, state_dict) or (
                self.titan.adapter.to_hf
            )
        return _in_dtype(self._hf_layout(state_dict), self.cfg.publish_dtype)

    def _learn_peft_layout(self) -> None:
        """Learns, on rank 0, where each adapter goes in PEFT's layout: the HF name and row
        order of the weight it adapts. A collective (the base weights are gathered once)."""
        state_dict = self._full_state_dict()
        if self.rank != 0:
            return
        base = {k: v for k, v in state_dict.items() if not is_adapter(k)}
        layout = HfLayout.learn(self.titan.adapter, base)
        if layout is None:
            raise ValueError(
                f"LoRA: {self.titan.family}'s HF adapter does more than rename tensors and "
                "reorder rows, so its adapters have no PEFT layout here"
            )
        self._peft_layout = PeftLayout(layout, [k for k in state_dict if is_adapter(k)])

    def _full_state_dict(self, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's full tensors (or its LoRA adapters alone) on rank 0. On one unsharded
        rank they alias the live parameters, which is fine: publishing and exporting copy them
        before the next step."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        if self.world == 1 and not isinstance(self.model, FSDPModule):
            # Nothing to gather (get_model_state_dict: ~20 ms).
            state_dict = self.model.state_dict()
            if adapters_only:
                return {k: v for k, v in state_dict.items() if is_adapter(k)}
            return state_dict
        # A collective: rank 0 receives full tensors.
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapters_only
        )
        return get_model_state_dict(self.model, options=options)

    @endpoint
    async def export_hf(self, path: str, merged: bool = False) -> str:
        """Writes the current weights as a Hugging Face folder at `path`; returns `path`.

        Call on every rank (`.call`): gathering the full weights is a collective. Rank 0
        writes the folder (the source checkpoint's config and tokenizer, the trained weights)
        and replaces an existing one only once complete; transformers and vLLM load it as is.
        With LoRA the folder is a PEFT adapter (adapter_config.json, adapter_model.safetensors)
        for the source checkpoint, or with `merged`, the model with its adapters folded in.
        """
        return await self.compute.run(self._export_hf, path, merged)

    def _export_hf(self, path: str, merged: bool) -> str:
        from forge.models.hf_export import save_hf, save_peft

        source, lora = resolve_model(self.cfg.model), self.cfg.lora
        if lora is None or merged:
            state_dict = self._full_state_dict()
            if self.rank == 0:
                if lora is not None:
                    state_dict = merge(state_dict, lora)
                save_hf(self.titan.adapter.to_hf(state_dict), source, path)
        else:
            adapters = self._full_state_dict(adapters_only=True)
            if self.rank == 0:
                save_peft(self._peft_layout(adapters), peft_config(lora, str(source)), path)
        return path

    @endpoint
    async def save_checkpoint(self, background: bool | None = None) -> float:
        """Saves model, optimizer, scheduler, step and RNG as checkpoint `step-<step>`.

        In the background (default: the config's `async_save`) it returns once the state is
        staged; the checkpoint becomes `latest` when written. Returns the seconds it blocked.
        """
        return await self.compute.run(self.checkpointer.save, self.step, background)

    @endpoint
    async def wait_checkpoint(self) -> None:
        """Returns once the last background checkpoint write is complete."""
        await asyncio.to_thread(self.checkpointer.wait)

    @endpoint
    async def get_step(self) -> int:
        return self.step


def _length(episode: Episode) -> int:
    return len(episode.completion.prompt_ids) + len(episode.completion.token_ids)


def _in_dtype(state_dict: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """`state_dict` with its floating-point tensors in `dtype` (as they are if None)."""
    if dtype is None:
        return state_dict
    target = getattr(torch, dtype)
    return {k: v.to(target) if v.is_floating_point() else v for k, v in state_dict.items()}


def lr_factor(cfg: SchedulerConfig, step: int) -> float:
    """The learning-rate multiplier at `step` (warm-up, then decay to min_lr_ratio)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant" or cfg.decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
    shape = 1 - progress if cfg.decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def _all_sum(value: float) -> float:
    return _all_reduce([value], dist.ReduceOp.SUM)[0]


def _all_max(value: float) -> float:
    return _all_reduce([value], dist.ReduceOp.MAX)[0]


def _all_sum_each(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over every rank, in one collective (every rank has the same keys)."""
    keys = sorted(values)
    return dict(zip(keys, _all_reduce([values[k] for k in keys], dist.ReduceOp.SUM), strict=True))


def _all_reduce(values: list[float], op: Any) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _load_full(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Loads a full (unsharded) state dict into a sharded model; every rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, state_dict, options=options)
