"""RewardActor: scores completions with named reward functions, each call under a deadline.

    reward = await RewardActor.options(num_replicas=2).as_service(
        RewardConfig(functions=["reasoning_gym", "format"], weights={"format": 0.1})
    )
    results = await reward.evaluate.route(rows, texts)  # one RewardResult per text
    episode.reward, episode.rewards = results[0].reward, results[0].rewards

The functions run in worker processes (forge.data.reward_runner): a function that raises or
overruns `timeout_s` scores 0 on that completion, is named in `RewardResult.failed` and counted
in `stats()`, its first failure of each kind is logged, and the actor keeps serving. A checker
that raises on the model's answer (a reasoning-gym `score_answer`) is such a failure, not a 0.
"""

from dataclasses import dataclass, field
from typing import Any

from monarch.actor import endpoint
from monarch.actor.concurrent import concurrent_endpoint

from forge.controller import ForgeActor, retry_safe
from forge.data.reward_runner import RewardResult, RewardRunner
from forge.data.rewards import RewardFn, resolve_reward


@dataclass
class RewardConfig:
    """Which reward functions score a completion, and how.

    Args:
        functions: names in forge.data.rewards.REWARD_FUNCTIONS ("reasoning_gym",
            "math_verify", "format"), "module:function" import paths, or names given to
            RewardActor's `custom` argument; none where the environment's own rewards are
            the whole reward (the run then starts no reward service).
        weights: name -> weight in the total reward; unlisted functions weigh 1.0.
        timeout_s: deadline of one function on one completion.
        num_workers: worker processes running the functions (calls run one at a time in each).
        startup_timeout_s: deadline for a worker to start and import the functions.
    """

    functions: list[str] = field(default_factory=lambda: ["reasoning_gym"])
    weights: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 5.0
    num_workers: int = 1
    startup_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if len(set(self.functions)) != len(self.functions):
            raise ValueError(f"functions: {self.functions} names a function twice")
        unknown = sorted(set(self.weights) - set(self.functions))
        if unknown:
            raise ValueError(f"weights: {unknown} not in functions {self.functions}")
        if self.timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("timeout_s and startup_timeout_s must be positive")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {self.num_workers}")


class RewardActor(ForgeActor):
    """Scores (row, text) pairs with the configured reward functions.

    Args:
        config: the functions and their deadline.
        custom: name -> reward function, for functions that are not importable by name
            (defined in a notebook or a test); `config.functions` must list their names.
    """

    def __init__(
        self, config: RewardConfig | None = None, custom: dict[str, RewardFn] | None = None
    ) -> None:
        super().__init__()
        self.config = config or RewardConfig()
        self.custom = dict(custom or {})
        self.runner: RewardRunner | None = None

    @endpoint
    async def setup(self) -> None:
        """Resolves the functions and starts the workers; a bad name fails here."""
        functions = {
            name: self.custom[name] if name in self.custom else resolve_reward(name)
            for name in self.config.functions
        }
        self.runner = RewardRunner(
            functions,
            self.config.weights,
            timeout_s=self.config.timeout_s,
            num_workers=self.config.num_workers,
            startup_timeout_s=self.config.startup_timeout_s,
        )
        await self.runner.start()

    @concurrent_endpoint
    @retry_safe
    async def evaluate(self, rows: list[dict[str, Any]], texts: list[str]) -> list[RewardResult]:
        """Scores `texts[i]` (a completion) against `rows[i]` (its dataset row).

        Returns one RewardResult per text: the weighted total, each function's score, and the
        functions that failed on it (scored 0).
        """
        return await self._runner().evaluate(rows, texts)

    @endpoint
    async def stats(self) -> dict[str, Any]:
        """Counts since setup: calls, errors and timeouts per function, worker restarts."""
        return self._runner().stats()

    def _runner(self) -> RewardRunner:
        if self.runner is None:
            raise RuntimeError("RewardActor.setup has not run")
        return self.runner

    async def __cleanup__(self, exc: Exception | None) -> None:
        if self.runner is not None:
            await self.runner.close()
            self.runner = None
