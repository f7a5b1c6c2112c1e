"""The trainer's share of calibration (forge.placement.calibration): its passes timed on a real
batch on this machine, which the placement planner's cost model predicts a step from."""

import math
import time

import torch

from forge.actors.trainer.collectives import all_max
from forge.actors.trainer.micro_batches import micro_batches
from forge.actors.trainer.training import Training
from forge.data.collate import collate
from forge.data.episode import Episode


def calibrate(training: Training, episodes: list[Episode], count: int) -> dict[str, float]:
    """Times `count` forward and backward passes of this rank's `episodes` (and forward passes
    alone), and scales them to the whole batch by padded tokens, the slowest rank's.

    Returns {"train_s": one step on the batch, "stale_s": what the exact mismatch pass adds
    when the batch is one version old}. Changes no weight, no optimizer state and no random
    state (LoRA dropout draws from it): a run's training replays without its calibration.
    """
    device = training.model.device
    with torch.random.fork_rng(devices=[] if device is None else [device]):
        return _timed_passes(training, episodes, count)


def _timed_passes(training: Training, episodes: list[Episode], count: int) -> dict[str, float]:
    model, cfg = training.model, training.cfg
    model.module.train()
    micro = [
        collate(chunk, training.pad_id)
        for chunk, _ in micro_batches(episodes, cfg.micro_batch_size)
    ]
    tokens = [b.input_ids.numel() for b in micro]
    # Spread over the length-sorted micro-batches.
    picked = sorted({round(i * (len(micro) - 1) / max(count - 1, 1)) for i in range(count)})
    # Untimed first, the longest first: the timed passes then find the heap grown to a
    # step's size, as a run's steps do (growing it faults pages in).
    for i in reversed(picked):
        training.forward(micro[i])[1].backward()
    # Then as a step starts: no gradients.
    training.optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for i in picked:
        training.forward(micro[i])[1].backward()
    backward = time.perf_counter() - start
    start = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.trained_parameters(), cfg.max_grad_norm)
    with torch.no_grad():
        copies = [p.detach().clone() for p in model.trained_parameters()]
    # The step's own passes over every parameter: clip, clone, fused AdamW (about two).
    per_step = (time.perf_counter() - start) * 3
    training.optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.no_grad():
        for i in picked:
            training.forward(micro[i])
        forward = time.perf_counter() - start
        start = time.perf_counter()
        with model.swapped(copies):  # the exact mismatch pass swaps weights in and out
            pass
        swap = time.perf_counter() - start
    del copies
    scale = all_max(sum(tokens) / sum(tokens[i] for i in picked))
    # A stale batch: the sampled share of its sequences forward, under swapped weights.
    sampled = math.ceil(len(episodes) * cfg.exact_mismatch_sample) / len(episodes)
    return {
        "train_s": all_max(backward) * scale + all_max(per_step),
        "stale_s": all_max(forward) * scale * sampled + all_max(swap),
    }
