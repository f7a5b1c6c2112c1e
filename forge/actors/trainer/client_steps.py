"""Training driven call by call from outside, in the Tinker API's shape: `forward_backward`
adds a batch's gradients, `optim_step` applies everything added since the last one with the
Adam settings the call gives. The loss is a Tinker built-in (forge.losses.tinker): a sum over
tokens, so gradients from several calls, micro-batches and ranks simply add up.
"""

from dataclasses import dataclass

import torch

from forge.actors.trainer.collectives import all_sum
from forge.actors.trainer.training import Training
from forge.losses.tinker import per_token_loss
from forge.models.titan import candidate_logprobs


@dataclass
class TokenDatum:
    """One sequence of a forward or forward_backward call.

    Attributes:
        tokens: the model's input; position i predicts `inputs["target_tokens"][i]`.
        inputs: "target_tokens" and the loss's other per-token inputs, each len(tokens) long.
    """

    tokens: list[int]
    inputs: dict[str, list[float]]


@dataclass
class AdamStep:
    """One optim_step's settings (the Tinker API's AdamParams)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


class ClientSteps:
    """Forward, forward-backward and optimiser steps on `training`'s model and optimizer.

    Args:
        training: the trainer's model, optimizer and micro-batch size.
    """

    def __init__(self, training: Training) -> None:
        self.training = training
        self.model = training.model

    def forward_backward(
        self, data: list[TokenDatum], loss: str, config: dict[str, float], backward: bool
    ) -> tuple[list[list[float]], list[list[float]], float]:
        """Each datum's target logprobs and per-token loss, and the loss summed over this
        rank's `data` and the other ranks'; with `backward`, its gradients are added to those
        held."""
        size = self.training.cfg.micro_batch_size or max(len(data), 1)
        logprobs: list[list[float]] = []
        losses: list[list[float]] = []
        total = 0.0
        self.model.module.train(backward)
        for start in range(0, len(data), size):
            chunk = data[start : start + size]
            with torch.set_grad_enabled(backward):
                target, mask, inputs = self._forward(chunk)
                per_token = per_token_loss(loss, target, inputs, mask, config)
                summed = per_token.sum()
                if backward:
                    summed.backward()
            total += float(summed.detach())
            lengths = [len(d.tokens) for d in chunk]
            logprobs += _rows(target, lengths)
            losses += _rows(per_token, lengths)
        return logprobs, losses, all_sum(total)

    def optim_step(self, adam: AdamStep) -> dict[str, float]:
        """Applies the gradients added since the last step with `adam`'s settings, then drops
        them; returns the gradient norm (before clipping)."""
        from torchtitan.distributed import utils as dist_utils

        optimizer = self.training.optimizer
        for group in optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        params = self.model.trained_parameters()
        clip = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
        grad_norm = float(dist_utils.clip_grad_norm_(params, clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm}

    def _forward(
        self, chunk: list[TokenDatum]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The target tokens' logprobs [batch, longest], the real positions, and the loss's
        inputs padded alike."""
        longest = max(len(d.tokens) for d in chunk)
        pad = self.training.pad_id
        # One position more than the longest input: the logits at position i score the target
        # at i, which need not be the input's next token.
        input_ids = torch.tensor([d.tokens + [pad] * (longest + 1 - len(d.tokens)) for d in chunk])
        mask = torch.tensor([[i < len(d.tokens) for i in range(longest)] for d in chunk])
        padded = {  # every datum has the same inputs (the server checks them)
            name: torch.tensor([d.inputs[name] + [0] * (longest - len(d.tokens)) for d in chunk])
            for name in chunk[0].inputs
        }
        targets = padded.pop("target_tokens").long().unsqueeze(-1)
        with self.model.precision():
            _, chosen = candidate_logprobs(
                self.model.module,
                self.model.to_device(input_ids),
                self.model.to_device(targets),
                1.0,
                self.training.cfg.logits_chunk_tokens,
            )
        inputs = {name: self.model.to_device(t.float()) for name, t in padded.items()}
        return chosen.squeeze(-1).float(), self.model.to_device(mask), inputs


def _rows(values: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    """Each row of `values` cut to its datum's length."""
    rows = values.detach().float().cpu()
    return [row[:n].tolist() for row, n in zip(rows, lengths, strict=True)]
