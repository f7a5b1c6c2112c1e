"""Supervised fine-tuning: cross-entropy on the answer tokens only."""

from torch import Tensor

from forge.losses.aggregation import Aggregation, aggregate


def sft_loss(
    logprobs: Tensor,
    mask: Tensor,
    aggregation: Aggregation = "token_mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the masked (answer) tokens; prompt tokens carry no loss.

    Args:
        logprobs: [batch, seq] log-probabilities of the target tokens, with grad.
        mask: [batch, seq] bool or 0/1, the answer tokens.
        aggregation, norm_length: as in forge.losses.aggregation.aggregate.

    Returns:
        (loss, metrics) with metrics["loss"], detached.
    """
    loss = aggregate(-logprobs, mask.bool(), aggregation, norm_length)
    return loss, {"loss": loss.detach()}
