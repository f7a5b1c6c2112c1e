"""Reinforcement learning with tinker-cookbook's own RL loop against `forge serve`.

The loop is the cookbook's `tinker_cookbook.rl.train.main`, unchanged: each step it samples
groups of answers from a sampler on the current weights, grades them, trains with importance
sampling and publishes the new weights. What this script adds is a dataset of its own, as a
cookbook user would write one: `AdditionsBuilder`, single-turn questions read from a local
jsonl file (`{"question": ..., "answer": <int>}` per line; the hundred one-digit additions
beside this script by default), some held out for the cookbook's test-set evaluator. A reply
scores 1 when its last integer is the answer.

Every field of the cookbook's RL `train.Config` can be set on the command line (chz syntax),
`base_url` included. It runs in the Tinker client environment (`make tinker-env` builds
`.venv-tinker`) and does not import forge:

    .venv-tinker/bin/python examples/tinker/rl_additions.py \\
        base_url=http://127.0.0.1:8000 model_name=/path/to/SmolLM2-135M-Instruct max_steps=6
"""

import json
import random
import re
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import chz
from client_settings import RENDERER, run
from tinker_cookbook import cli_utils, renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

DATA = Path(__file__).with_name("one_digit_additions.jsonl")
INTEGER = re.compile(r"-?\d+")
FEWSHOT: list[renderers.Message] = [
    {"role": "user", "content": "What is 4 + 5?"},
    {"role": "assistant", "content": "9"},
]


class QuestionEnv(ProblemEnv):
    """One question; the reply's last integer is its answer."""

    def __init__(self, question: str, answer: int, renderer: renderers.Renderer):
        super().__init__(renderer, convo_prefix=FEWSHOT)
        self.question, self.answer = question, answer

    def get_question(self) -> str:
        return self.question

    def check_answer(self, sample_str: str) -> bool:
        found = INTEGER.findall(sample_str.replace(",", ""))
        return bool(found) and int(found[-1]) == self.answer

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return str(self.answer)


class Questions(RLDataset):
    """Rows in batches of `batch_size` groups, each `group_size` tries at one question."""

    def __init__(self, rows: list[dict], batch_size: int, group_size: int, renderer):
        self.rows, self.batch_size, self.group_size = rows, batch_size, group_size
        self.renderer = renderer

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        rows = self.rows[index * self.batch_size : (index + 1) * self.batch_size]
        return [
            ProblemGroupBuilder(
                env_thunk=partial(QuestionEnv, r["question"], r["answer"], self.renderer),
                num_envs=self.group_size,
                dataset_name="additions",
            )
            for r in rows
        ]

    def __len__(self) -> int:
        return len(self.rows) // self.batch_size


def read_rows(path: str) -> list[dict]:
    """The file's rows; a row without a string question and an integer answer is refused,
    named by its line."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        row = json.loads(line) if line.strip() else None
        if not (
            isinstance(row, dict)
            and isinstance(row.get("question"), str)
            and isinstance(row.get("answer"), int)
        ):
            raise ValueError(f"{path}:{number}: expected {{'question': str, 'answer': int}}")
        rows.append(row)
    return rows


@chz.chz
class AdditionsBuilder(RLDatasetBuilder):
    """Training and held-out questions from a jsonl file."""

    model_name_for_tokenizer: str
    renderer_name: str = RENDERER
    file_path: str = str(DATA)
    batch_size: int = 4
    group_size: int = 8
    test_size: int = 32
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset]:
        rows = read_rows(self.file_path)
        random.Random(self.seed).shuffle(rows)
        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
        test, train_rows = rows[: self.test_size], rows[self.test_size :]
        return (
            Questions(train_rows, self.batch_size, self.group_size, renderer),
            Questions(test, len(test), 1, renderer),
        )


def build_config_blueprint(model_name: str, renderer_name: str) -> chz.Blueprint[train.Config]:
    """The cookbook's RL config over `AdditionsBuilder`."""
    return chz.Blueprint(train.Config).apply(
        {
            "log_path": cli_utils.runs_path("forge-rl-additions"),
            "model_name": model_name,
            "recipe_name": "forge_rl_additions",
            "renderer_name": renderer_name,
            # The class and its fields apart, so that `dataset_builder.batch_size=...` and the
            # like can be set on the command line.
            "dataset_builder": AdditionsBuilder,
            "dataset_builder.model_name_for_tokenizer": model_name,
            "dataset_builder.renderer_name": renderer_name,
            "learning_rate": 3e-4,
            "lora_rank": 16,
            "max_tokens": 16,
            "eval_every": 4,
            "save_every": 0,
        }
    )


if __name__ == "__main__":
    run(build_config_blueprint, train.main)
