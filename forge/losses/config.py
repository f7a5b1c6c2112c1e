"""The trainer's loss settings (`trainer.loss`), read by every objective: GRPO takes them all;
distillation its importance-sampling correction and aggregation; SFT its aggregation."""

from dataclasses import dataclass
from typing import Literal, get_args

from forge.losses.aggregation import AGGREGATIONS, Aggregation

ISCorrection = Literal["none", "tis", "mis"]
IS_CORRECTIONS: tuple[str, ...] = get_args(ISCorrection)


@dataclass
class LossConfig:
    """Settings of the loss, shared by the objectives (forge.losses.objectives).

    Attributes:
        clip_eps_low: the ratio is clipped below at 1 - clip_eps_low.
        clip_eps_high: the ratio is clipped above at 1 + clip_eps_high. Larger than clip_eps_low
            ("clip-higher", DAPO) so that unlikely tokens with positive advantage can still grow,
            which keeps entropy from collapsing.
        kl_coef: beta, the weight of the k3 KL to the reference policy (0: no KL term).
        is_correction: "none", "tis" (truncated IS) or "mis" (masked IS); see
            forge.losses.importance.
        tis_cap: C, the TIS weights are min(rho, C).
        mis_low, mis_high: MIS keeps a token iff mis_low <= rho <= mis_high.
        aggregation: how per-token losses become one number; see forge.losses.aggregation.
        norm_length: the constant L of "sequence_sum_norm" (None: the padded length).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    is_correction: ISCorrection = "none"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    aggregation: Aggregation = "token_mean"
    norm_length: int | None = None

    @property
    def corrects(self) -> bool:
        """Whether the generator's logprobs reweight (TIS) or mask (MIS) the loss's tokens."""
        return self.is_correction != "none"

    def __post_init__(self) -> None:
        if not 0 <= self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low must be in [0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.is_correction not in IS_CORRECTIONS:
            raise ValueError(
                f"is_correction must be one of {IS_CORRECTIONS}, got {self.is_correction!r}"
            )
        # rho = 1 (the engines agree) must pass each correction untouched.
        if self.tis_cap < 1:
            raise ValueError(f"tis_cap must be >= 1, got {self.tis_cap}")
        if not 0 <= self.mis_low <= 1 <= self.mis_high:
            raise ValueError(
                f"need 0 <= mis_low <= 1 <= mis_high, got mis_low={self.mis_low}, "
                f"mis_high={self.mis_high}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(f"norm_length must be >= 1, got {self.norm_length}")
