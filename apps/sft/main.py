"""Supervised fine-tuning on chat-formatted (prompt, answer) rows, loss on answer tokens only.

    forge run apps/sft/main.py --config configs/sft/smollm2_cpu.yaml

Rows come from the `data:` section every app shares (a reasoning-gym task, a local file or
folder, a Hugging Face dataset); the answer, put into `target.template` (or a column of full
answers, `target.column`), is the assistant's target. Batches group rows of similar
length (forge.data.sft.LengthBucketBatcher), so padding stays small: `train/padding_fraction`
reports it. Every `eval.interval` steps the weights go to the generators, which answer the
held-out rows greedily (`eval/reward`), and the trainer scores the held-out answers
(`eval/loss`, the same loss without a step): one eval, one line of eval.jsonl.
"""

import time
from dataclasses import dataclass, field

from forge.config import at_least, config_error
from forge.data.datasets import PromptDataset
from forge.data.episode import Episode
from forge.data.sft import (
    LengthBucketBatcher,
    SFTExamples,
    SFTTarget,
    padding_fraction,
    sft_episode,
    tokenize_row,
)
from forge.loop import Run, RunConfig, RunParts, TrainerDied
from forge.loop.evaluation import EvalRows
from forge.models import load_tokenizer
from forge.observability import MetricsConfig, record_metric

# The trainer's figures, and each eval's: SFT's generators only answer the held-out eval.
CONSOLE_KEYS = ["train/loss", "train/tokens_per_s", "eval/loss", "eval/reward"]


@dataclass
class Config(RunConfig):
    """RunConfig plus what the assistant learns to answer.

    Args:
        target: the answer template, or the column of full answers.
        batch_size: sequences per optimizer step.
        bucket_window: batches read ahead and sorted by length (1: no bucketing).
        metrics: RunConfig's, the console showing the trainer's figures and each eval's.
    """

    run_dir: str = "runs/sft"
    target: SFTTarget = field(default_factory=SFTTarget)
    batch_size: int = 16
    bucket_window: int = 8
    metrics: MetricsConfig = field(
        default_factory=lambda: MetricsConfig(console_keys=list(CONSOLE_KEYS))
    )

    OBJECTIVE = "sft"

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, 1, "batch_size", "bucket_window")
        if self.target.column is not None and self.target.column == self.data.answer_column:
            # The rows carry that column as the answer: the template does the job.
            raise ValueError(
                "target.column is data.answer_column: leave it unset and set target.template "
                "to '{answer}'"
            )


class SFT(Run):
    """Train on bucketed batches; publish and evaluate every `eval.interval` steps."""

    cfg: Config
    plot_keys = ("train/loss", "eval/loss", "eval/reward", "train/padding_fraction")

    def __init__(self, cfg: Config, parts: RunParts) -> None:
        """The tokenizer and the batches (the trainer, generators and reward are Run's)."""
        super().__init__(cfg, parts)
        self.tokenizer = load_tokenizer(cfg.trainer.model)
        examples = SFTExamples(self.data, cfg.target, self.tokenizer)
        self.batches = LengthBucketBatcher(examples, cfg.batch_size, cfg.bucket_window, cfg.seed)
        self.first_state = {"batches": self.batches.state_dict()}
        rows = self.evaluator.rows if self.evaluator is not None else []
        self.held_out_answers = [
            sft_episode(tokenize_row(row, self.tokenizer, cfg.target), f"eval-{i}")
            for i, row in enumerate(rows)
        ]

    @classmethod
    def open_data(cls, cfg: Config) -> tuple[PromptDataset, EvalRows | None]:
        """Run's, and the target column checked in the training and the eval rows."""
        data, held_out = super().open_data(cfg)
        with config_error("target.column"):
            cfg.target.check(data.name, data.columns)
            if held_out is not None:
                cfg.target.check(held_out.source, held_out.columns)
        return data, held_out

    async def state_dict(self) -> dict:
        return {"batches": self.batches.state_dict()}

    async def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state["batches"])

    async def begin(self) -> None:
        """Run's, the starting weights' held-out loss first: it joins their eval (step 0)."""
        if self.evaluator is not None and not self.resumed:
            self.evaluator.attach(0, {"loss": await self.eval_loss()})
        await super().begin()

    async def run(self) -> None:
        start = time.perf_counter()
        while self.version < self.last_step:
            step = self.version + 1
            try:
                await self.train_on_next_batch(step)
                await self.log_step(step, start)
                # After the step's row: killed in between, the run resumes from the previous
                # checkpoint and takes the step again, rather than with the step's row lost.
                await self.lifecycle.checkpoint(step, self.state_dict)
            except TrainerDied as e:
                await self.restart_trainer(e)
                # The batches after the checkpoint are trained again, in the same order.
                state = self.folder.load_driver_state(self.version) or self.first_state
                await self.load_state_dict(state)

    async def train_on_next_batch(self, step: int) -> None:
        """One step on the next batch; publish and evaluate when due."""
        batch = next(self.batches)
        episodes = [sft_episode(e, f"{step}-{i}") for i, e in enumerate(batch)]
        record_metric("train/padding_fraction", padding_fraction(episodes))
        batch = _split(episodes, self.world)
        self.logs.batch(step, self.version, batch)
        # The generators serve only the held-out eval: they get weights when it is due.
        async with self.trainer.turn():  # the step, and eval when due: one turn
            await self.train(batch)
            if self.evaluator is not None and self.evaluator.due(step):
                # The loss first: it joins the eval that publishing starts.
                self.evaluator.attach(step, {"loss": await self.eval_loss()})
                await self.sync.publish(step, self.version)

    async def eval_loss(self) -> float:
        """The trainer's loss on the held-out rows' reference answers, batch by batch."""
        total = tokens = 0.0
        size = self.cfg.batch_size
        for i in range(0, len(self.held_out_answers), size):
            chunk = self.held_out_answers[i : i + size]
            n = sum(len(e.completion.token_ids) for e in chunk)
            loss = await self.trainer.eval_loss(_split(chunk, self.world))
            total, tokens = total + loss * n, tokens + n
        return total / tokens


def _split(episodes: list[Episode], ranks: int) -> list[list[Episode]]:
    """Episodes dealt round-robin to the trainer's data-parallel ranks."""
    return [episodes[r::ranks] for r in range(ranks)]


async def main(cfg: Config) -> None:
    await SFT.main(cfg)
