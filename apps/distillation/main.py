"""On-policy distillation: the student samples, a teacher scores every sampled token, and the
student minimises the per-token reverse KL to the teacher on its own samples.

    forge run apps/distillation/main.py --config configs/distillation/smollm2_cpu.yaml

The loop is forge.loop's (asynchronous by default, staleness bounded by the admission gate;
`trainer.loss.is_correction: tis` reweights samples of an older generator). What makes it
distillation is `score`: a teacher service (replicas, retry-safe; a torchtitan forward pass or
vLLM prompt logprobs, `teacher.backend`) returns log q of every sampled token, and the trainer's
`distill` objective turns log p - log q into per-token advantages; or, with `teacher_top_k`, the
teacher's k most likely tokens at every position too, and the objective computes each
position's KL over them instead of estimating it from the one sampled token.
"""

import time
from dataclasses import dataclass, field

from forge.actors.reference import ReferenceConfig, ReferenceModel
from forge.actors.vllm.scorer import MAX_TOP_K, TopLogprobs
from forge.data import Episode
from forge.envs.runner import EpisodeOutcome
from forge.loop import RLConfig, RLLoop, RunParts
from forge.losses.objectives import TOP_K_IS_CORRECTION
from forge.models.prune import PrunedModel
from forge.observability import Reduce, record_metric
from forge.observability.busy import BusyClock
from forge.placement.roles import Resources, Role


@dataclass
class Config(RLConfig):
    """RLConfig plus the teacher.

    Args:
        teacher: the teacher model, its backend and temperature (the generator's).
        teacher_resources: how many teacher replicas, on which devices.
        student: when set, a layer-pruned copy of a model that generator.model and
            trainer.model both become (the compression use case: a student initialised from
            its teacher's weights).
        teacher_top_k: 0: the KL at each position is estimated from the sampled token; k > 0:
            computed over the teacher's k most likely tokens there (plus one bucket for the
            rest), which needs trainer.loss.is_correction 'none'.
    """

    run_dir: str = "runs/distill"
    teacher: ReferenceConfig = field(default_factory=ReferenceConfig)
    teacher_resources: Resources = field(default_factory=Resources)
    student: PrunedModel | None = None
    teacher_top_k: int = 0

    OBJECTIVE = "distill"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.teacher.temperature != self.generator.sampling.temperature:
            raise ValueError("teacher.temperature must equal generator.sampling.temperature")
        if self.teacher_top_k < 0:
            raise ValueError(f"teacher_top_k must be >= 0, got {self.teacher_top_k}")
        if self.teacher.backend == "vllm" and self.teacher_top_k > MAX_TOP_K:
            raise ValueError(f"teacher_top_k must be <= {MAX_TOP_K} on the vllm backend")
        if self.teacher_top_k and self.trainer.loss.corrects:
            raise ValueError(TOP_K_IS_CORRECTION)

    def roles(self) -> list[Role]:
        teacher = Role(
            "teacher",
            ReferenceModel,
            (self.teacher,),
            self.teacher_resources,
            "teacher_resources",
            service=True,
        )
        return [*super().roles(), teacher]


class Distill(RLLoop):
    """Teacher logprobs for every sampled token; per-sequence reverse KL in the metrics."""

    cfg: Config
    plot_keys = ("train/reverse_kl", "eval/reward", "teacher/tokens_per_s", "train/tokens_per_s")

    @classmethod
    async def start(cls, cfg: Config) -> "Distill":
        if cfg.student is not None:  # the pruned copy is written once, then reused
            cfg.generator.model = cfg.trainer.model = str(cfg.student.path())
        return await super().start(cfg)

    def __init__(self, cfg: Config, parts: RunParts) -> None:
        super().__init__(cfg, parts)
        self.teacher = parts.actors["teacher"]
        self.teacher_busy = BusyClock()

    async def score(self, group: int, row: dict, outcomes: list[EpisodeOutcome]) -> list[Episode]:
        completions = [o.trajectory.completion() for o in outcomes]
        pairs = [(c.prompt_ids, c.token_ids) for c in completions]
        start = time.perf_counter()
        k = self.cfg.teacher_top_k
        async with self.teacher_busy:
            if k:
                teacher = await self.teacher.top_logprobs.route(pairs, k)
            else:
                teacher = [
                    TopLogprobs(lp, None, None) for lp in await self.teacher.logprobs.route(pairs)
                ]
        tokens = sum(len(c.token_ids) for c in completions)
        record_metric("teacher/tokens_per_s", tokens / (time.perf_counter() - start))
        episodes = []
        for i, (c, t) in enumerate(zip(completions, teacher, strict=True)):
            lp = t.logprobs
            episodes.append(
                Episode(
                    f"{group}-{i}",
                    str(group),
                    c,
                    teacher_logprobs=lp,
                    teacher_top_ids=t.top_ids,
                    teacher_top_logprobs=t.top_logprobs,
                )
            )
            # log p - log q under the generator's weights, over the tokens the student sampled:
            # the KL each sample was drawn with.
            sampled = c.sampled()
            diffs = [s - t for s, t, m in zip(c.logprobs, lp, sampled, strict=True) if m]
            kl = sum(diffs) / max(len(diffs), 1)
            record_metric("rollout/seq_reverse_kl", kl)
            record_metric("rollout/seq_reverse_kl_std", kl, Reduce.STD)
            record_metric("rollout/seq_reverse_kl_max", kl, Reduce.MAX)
            record_metric("rollout/seq_reverse_kl_min", kl, Reduce.MIN)
        return episodes

    async def log_step(self, step: int, start: float) -> dict[str, float]:
        record_metric("teacher/idle_fraction", self.teacher_busy.idle_fraction())
        for m in self.teacher.metrics():
            record_metric("teacher/deaths", m["deaths"], Reduce.SUM)
            record_metric("teacher/recoveries", m["recoveries"], Reduce.SUM)
            record_metric("teacher/hangs", m["hangs"], Reduce.SUM)
        return await super().log_step(step, start)


async def main(cfg: Config) -> None:
    await Distill.main(cfg)
