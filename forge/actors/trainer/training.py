"""The training step: forward and backward passes over a rank's micro-batches, then one
optimiser step; and the passes that share its micro-batches and objective without a step (a
held-out loss, per-token logprobs).

Losses are normalised by the global token (or sequence) count, and FSDP sums gradients, so N
processes compute exactly what one process computes on the whole batch.
"""

import dataclasses
import time
from collections import defaultdict
from typing import Any

import torch

from forge.actors.trainer.collectives import all_max, all_sum, all_sum_each
from forge.actors.trainer.config import OPTIMISATION_FIELDS, TrainerConfig, lr_factor
from forge.actors.trainer.guard import Guard
from forge.actors.trainer.micro_batches import micro_batches
from forge.actors.trainer.mismatch import KL_PARTS, Mismatch
from forge.actors.trainer.model import Model
from forge.data.collate import Batch, collate, first_position, gather_tokens, pad_sequences
from forge.data.episode import Episode
from forge.losses import OBJECTIVES, ObjectiveInputs
from forge.models.titan import candidate_logprobs, token_logprobs
from forge.observability.laps import Laps
from forge.observability.memory import PeakMemory


class Training:
    """Trains `model` with the configured objective, optimizer and schedule.

    Args:
        cfg: the objective and loss, the optimizer and scheduler, micro-batching, logits
            chunking and the mismatch measurement.
        model: the model to train.
    """

    def __init__(self, cfg: TrainerConfig, model: Model) -> None:
        self.cfg = cfg
        self.model = model
        self.pad_id = 0
        o = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            model.trained_parameters(),
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=True,  # one kernel per step instead of a loop over parameters (CPU and GPU)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(cfg.scheduler, step)
        )
        self.mismatch = Mismatch(cfg, model, self.pad_id)
        self.guard = Guard(cfg.guard)

    def step(self, episodes: list[Episode], policy_version: int | None) -> dict[str, Any]:
        """One optimiser step on this rank's `episodes`; returns metrics over every rank, and
        under "blown" why the divergence guard did not apply it (None: applied).

        `policy_version` is the version of the current weights: episodes of that version give
        the mismatch KL, older ones the policy drift since. None counts every episode as current.
        """
        start, started_at = time.perf_counter(), time.time()
        peak, laps = PeakMemory(self.model.device), Laps()
        chunks = micro_batches(episodes, self.cfg.micro_batch_size)
        micro = [(collate(chunk, self.pad_id), real) for chunk, real in chunks]
        norms = [self._normaliser(batch) if real else 0.0 for batch, real in micro]
        global_norm = max(all_sum(sum(norms)), 1.0)
        # SFT targets come from data, not from a generator: there is nothing to compare with.
        sampled = self.cfg.objective != "sft"
        sums: dict[str, float] = defaultdict(float)  # loss and metrics, weighted by norm
        kl = dict.fromkeys(KL_PARTS, 0.0)  # generator-vs-trainer KL parts
        laps.lap("collate")
        if sampled:
            # First, while no activation or gradient is held: it adds nothing to the peak. In
            # eval mode: the generator sampled without dropout, and a trainer just loaded (no
            # previous weights, no pass) must draw the same random numbers as one that was not.
            self.model.module.eval()
            sums["previous_positions"] = self.mismatch.add_previous(episodes, kl)
            laps.lap("previous")
        self.model.module.train()
        for i, ((batch, _), norm) in enumerate(zip(micro, norms, strict=True)):
            self._sync_gradients(last=i == len(micro) - 1)
            logprobs, loss, metrics = self.forward(batch)
            laps.lap("forward")
            (loss * norm / global_norm).backward()
            laps.lap("backward")
            for name, value in {"loss": loss.detach(), **metrics}.items():
                sums[name] += float(value) * norm
            if sampled and norm:
                self.mismatch.add(logprobs.detach(), batch, policy_version, kl)
            laps.lap("other")
        mismatch = self.mismatch.metrics(kl) if sampled else {}
        if sampled and policy_version is not None:
            self.mismatch.keep(policy_version)
            laps.lap("keep")
        sums["tokens"] = sum(float((b.input_ids != self.pad_id).sum()) for b, real in micro if real)
        sums["positions"] = sum(float(b.input_ids.numel()) for b, real in micro if real)
        totals = all_sum_each(sums)
        laps.lap("other")
        grad_norm, blown = self._clip_and_step(totals["loss"] / global_norm)
        laps.lap("optimizer")
        counts = ("tokens", "positions", "previous_positions")
        return {
            **{name: value / global_norm for name, value in totals.items() if name not in counts},
            "grad_norm": grad_norm,
            "skipped": float(blown is not None),
            "blown": blown,  # why it was not applied (the divergence guard), or None
            "lr": self.scheduler.get_last_lr()[0],
            "tokens": totals["tokens"],
            # Positions computed, padding included; by the previous weights' forward passes too.
            "positions": totals["positions"],
            "previous_positions": totals.get("previous_positions", 0.0),
            "tokens_per_s": totals["tokens"] / (time.perf_counter() - start),
            **laps.metrics(),  # seconds per part of the step, this rank's
            f"{peak.metric}": all_max(peak.gb()),
            **mismatch,
            "started_at": started_at,  # wall clock: the run's timeline
            "ended_at": time.time(),
        }

    def set_optimisation(self, cfg: TrainerConfig) -> None:
        """Takes `cfg`'s OPTIMISATION_FIELDS from the next step on: the loss, the clipping, the
        schedule, and AdamW's settings in the optimizer's groups (a checkpoint's load put its
        own there); its moments and step count stay.

        Raises:
            ValueError: `cfg` differs from the trainer's config in another field.
        """
        # How often the driver asks for checkpoints is the driver's (a live run changes it).
        interval = dataclasses.replace(cfg.checkpoint, interval=self.cfg.checkpoint.interval)
        cfg = dataclasses.replace(cfg, checkpoint=interval)
        fields = [f.name for f in dataclasses.fields(cfg)]
        other = [n for n in fields if n not in OPTIMISATION_FIELDS]
        if differ := [n for n in other if getattr(cfg, n) != getattr(self.cfg, n)]:
            raise ValueError(f"only {', '.join(OPTIMISATION_FIELDS)} may change, not {differ}")
        for name in OPTIMISATION_FIELDS:  # the scheduler's lambda reads self.cfg.scheduler
            setattr(self.cfg, name, getattr(cfg, name))
        self.guard.cfg = cfg.guard
        o = cfg.optimizer
        self.scheduler.base_lrs = [o.lr for _ in self.optimizer.param_groups]
        factor = lr_factor(cfg.scheduler, self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group.update(
                lr=o.lr * factor, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
            )

    def eval_loss(self, episodes: list[Episode]) -> float:
        """The objective's loss on this rank's `episodes` and the other ranks', without a step."""
        self.model.module.eval()
        total = norm = 0.0
        with torch.no_grad():
            for chunk, real in micro_batches(episodes, self.cfg.micro_batch_size):
                batch = collate(chunk, self.pad_id)
                _, loss, _ = self.forward(batch)
                weight = self._normaliser(batch) if real else 0.0
                total, norm = total + float(loss) * weight, norm + weight
        return all_sum(total) / max(all_sum(norm), 1.0)

    def logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per-token logprobs of each (prompt ids, completion ids) under the current weights,
        `micro_batch_size` sequences per forward pass."""
        self.model.module.eval()
        size = self.cfg.micro_batch_size or max(len(pairs), 1)
        out: list[list[float]] = []
        for start in range(0, len(pairs), size):
            input_ids, mask = pad_sequences(pairs[start : start + size], self.pad_id)
            with torch.no_grad(), self.model.precision():
                logprobs = token_logprobs(
                    self.model.module,
                    self.model.to_device(input_ids),
                    self.cfg.temperature,
                    self.cfg.logits_chunk_tokens,
                    first_position(mask),
                )
            out.extend(gather_tokens(logprobs.cpu(), mask))
        return out

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """This micro-batch's per-token logprobs, its loss (normalised by its own `_normaliser`)
        and the objective's metrics."""
        input_ids = self.model.to_device(batch.input_ids)
        chunk, temperature = self.cfg.logits_chunk_tokens, self.cfg.temperature
        top = None
        first = first_position(batch.mask)
        with self.model.precision():
            if batch.teacher_top_ids is None:
                logprobs = token_logprobs(self.model.module, input_ids, temperature, chunk, first)
            else:
                candidates = self.model.to_device(batch.teacher_top_ids)
                logprobs, top = candidate_logprobs(
                    self.model.module, input_ids, candidates, temperature, chunk, first
                )
        loss, metrics = self._loss(logprobs, batch, top)
        return logprobs, loss, metrics

    def _sync_gradients(self, last: bool) -> None:
        """FSDP reduces gradients after the last micro-batch only; before, it accumulates."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model.module, FSDPModule):
            self.model.module.set_requires_gradient_sync(last)

    def _loss(
        self, logprobs: torch.Tensor, batch: Batch, top: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The objective's loss over a micro-batch (normalised by `_normaliser`) and its
        metrics. `top`: the trainer's logprobs of the teacher's top k tokens, or None."""
        inputs = ObjectiveInputs(
            logprobs=logprobs,
            mask=self.model.to_device(batch.mask),
            behaviour_logprobs=self.model.to_device(batch.behaviour_logprobs),
            advantages=self.model.to_device(batch.advantages),
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
        return None if tensor is None else self.model.to_device(tensor)

    def _clip_and_step(self, loss: float) -> tuple[float, str | None]:
        """Clips the gradients and, unless the guard finds the step blown up, applies it.
        Returns the gradient norm before clipping and the guard's verdict."""
        from torchtitan.distributed import utils as dist_utils

        params = self.model.trained_parameters()
        grad_norm = float(dist_utils.clip_grad_norm_(params, self.cfg.max_grad_norm))
        blown = self.guard.verdict(loss, grad_norm)
        if blown is None:
            self.optimizer.step()
            self.scheduler.step()
            self.guard.applied(grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, blown
