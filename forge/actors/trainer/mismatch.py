"""KL(generator || trainer) during a step: the mismatch (the engines' disagreement on the same
tokens under the same weights) and, apart, the policy drift (older tokens against the current
weights)."""

import math

import torch

from forge.actors.trainer.collectives import all_max, all_sum_each
from forge.actors.trainer.config import TrainerConfig
from forge.actors.trainer.micro_batches import by_length
from forge.actors.trainer.model import Model
from forge.data.collate import Batch, collate, first_position
from forge.data.episode import Episode
from forge.losses import kl_k3, masked_sum
from forge.models.titan import token_logprobs

# The parts of the generator-vs-trainer KL a step sums over micro-batches, then over ranks.
KL_PARTS = (
    "tokens", "current", "current_kl", "older_kl", "previous", "previous_kl",
    "previous_sequences", "previous_sampled",
)  # fmt: skip


class Mismatch:
    """Adds up a step's KL parts (a dict with the keys of KL_PARTS) and reduces them to metrics.

    With `exact_mismatch` it keeps the weights before the last step, so that episodes one
    version old are scored under the weights that generated them.

    Args:
        cfg: the temperature, logits chunk, micro-batch size and exact mismatch settings.
        model: the trained model.
        pad_id: the token batches are padded with.
    """

    def __init__(self, cfg: TrainerConfig, model: Model, pad_id: int) -> None:
        self.cfg = cfg
        self.model = model
        self.pad_id = pad_id
        self._previous: tuple[int, list[torch.Tensor]] | None = None  # version, weights

    @property
    def kept(self) -> bool:
        """Whether a copy of the weights before the last step is held."""
        return self._previous is not None

    def keep(self, version: int) -> None:
        """Keeps a copy of the current weights as those of `version` (with `exact_mismatch`).
        Call it before the optimiser step: these weights generated the episodes of `version`."""
        if self.cfg.exact_mismatch:
            weights = [p.detach().clone() for p in self.model.trained_parameters()]
            self._previous = (version, weights)

    def add_previous(self, episodes: list[Episode], kl: dict[str, float]) -> int:
        """Adds the KL of a sample of the sequences the previous weights sampled, under those
        weights: `exact_mismatch_sample` of them (at least one), spread over their lengths.
        Nothing before a copy was kept. Returns the positions its forward passes computed.

        One forward pass per `micro_batch_size` of the sample; every rank runs as many as the
        rank with the most (fillers at weight 0), since FSDP's gathers pair up.
        """
        if self._previous is None:
            return 0
        version, weights = self._previous
        older = by_length([e for e in episodes if e.policy_version == version])
        kl["previous_sequences"] += len(older)
        take = math.ceil(len(older) * self.cfg.exact_mismatch_sample)
        sample = [older[i * len(older) // take] for i in range(take)] if take else []
        size = self.cfg.micro_batch_size or max(len(sample), 1)
        chunks = int(all_max(math.ceil(len(sample) / size)))
        if not chunks:
            return 0  # every rank skips the forward passes alike
        kl["previous_sampled"] += len(sample)
        model, positions = self.model, 0
        with torch.no_grad(), model.swapped(weights), model.precision():
            for i in range(chunks):
                chunk = sample[i * size : (i + 1) * size]
                batch = collate(chunk or episodes[:1], self.pad_id)
                part = model.to_device(batch.mask) & bool(chunk)
                before = token_logprobs(
                    model.module,
                    model.to_device(batch.input_ids),
                    self.cfg.temperature,
                    self.cfg.logits_chunk_tokens,
                    first_position(batch.mask),
                )
                behaviour = model.to_device(batch.behaviour_logprobs)
                kl["previous"] += float(part.sum())
                kl["previous_kl"] += float(masked_sum(kl_k3(behaviour, before), part))
                positions += batch.input_ids.numel()
        return positions

    def add(
        self, logprobs: torch.Tensor, batch: Batch, version: int | None, kl: dict[str, float]
    ) -> None:
        """Adds a micro-batch's token counts and per-token KL(generator || trainer) sums, from
        the step's `logprobs`: over tokens sampled by the current weights (`version`; None:
        every token), and over older ones (policy drift)."""
        mask = self.model.to_device(batch.mask)
        per_token = kl_k3(self.model.to_device(batch.behaviour_logprobs), logprobs)
        versions = torch.tensor([-1 if v is None else v for v in batch.policy_versions])
        is_current = (
            torch.ones_like(versions, dtype=torch.bool)
            if version is None
            else (versions == version)
        )
        current = self.model.to_device(is_current)[:, None] & mask
        older = mask & ~current
        kl["tokens"] += float(mask.sum())
        kl["current"] += float(current.sum())
        kl["current_kl"] += float(masked_sum(per_token, current))
        kl["older_kl"] += float(masked_sum(per_token, older))

    @staticmethod
    def metrics(kl: dict[str, float]) -> dict[str, float]:
        """KL(generator || trainer) on the same tokens under the same weights ("mismatch_kl"),
        over every rank's parts.

        Tokens of the current version use this step's logprobs. Tokens one version old use
        logprobs under the weights before the last step (`exact_mismatch` keeps a copy; a
        sample of those sequences, their share in "mismatch_previous_sampled"), so async
        training still measures the engines' disagreement alone; "policy_drift_kl" is the
        KL of older tokens to the current weights. A part with no tokens is left out.
        """
        t = all_sum_each(kl)
        out = {"current_token_fraction": t["current"] / max(t["tokens"], 1.0)}
        scored = t["current"] + t["previous"]
        if scored:
            out["mismatch_kl"] = (t["current_kl"] + t["previous_kl"]) / scored
        if t["tokens"] > t["current"]:
            out["policy_drift_kl"] = t["older_kl"] / (t["tokens"] - t["current"])
        if t["previous_sequences"]:  # the share of one-version-old sequences in mismatch_kl
            out["mismatch_previous_sampled"] = t["previous_sampled"] / t["previous_sequences"]
        return out
