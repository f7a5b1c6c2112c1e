"""GRPO, asynchronous by default: rollouts and training run at once, bounded in staleness.

    forge run apps/grpo/main.py --config configs/grpo/smollm2_cpu.yaml [key=value ...]

Rollout loop (several tasks): dataset -> generator.generate (G samples of one prompt) ->
rewards -> group advantages -> (reference logprobs) -> replay buffer; an admission gate keeps
at most (max_policy_age + 1) batches ahead of the trainer. Training loop: buffer.sample ->
trainer.train_step -> trainer.push_weights -> generator.update_weights.fanout. `mode: sync`
alternates the two strictly (generate a batch, then train on it): the baseline async mode is
measured against, and the same data as async mode with `max_policy_age: 0`.
"""

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forge.actors.dataset import DatasetActor
from forge.actors.generator import Generator, GeneratorConfig
from forge.actors.reference import ReferenceConfig, ReferenceModel
from forge.actors.replay_buffer import ReplayBuffer, ReplayBufferConfig
from forge.actors.reward import RewardActor, RewardConfig
from forge.actors.trainer import TitanTrainer, TrainerConfig
from forge.controller import ProvisionerConfig, init_provisioner, shutdown
from forge.data import Episode
from forge.data.admission import AdmissionGate
from forge.data.datasets import ReasoningGymConfig, easy_arithmetic
from forge.losses import group_advantages
from forge.observability import MetricLogger, MetricsConfig, Reduce, plot_run, record_metric
from forge.weights import torchstore_compat
from forge.weights.transport import delete_older_than, make_transport

MAX_FAILURES_IN_A_ROW = 10


@dataclass
class Resources:
    """Processes for one role: how many, and which devices (see ForgeActor.options)."""

    procs: int = 1
    hosts: int | None = None
    num_replicas: int = 1
    with_gpus: bool = False
    cpus_per_proc: int = 0


@dataclass
class Config:
    run_dir: str = "runs/grpo"
    steps: int = 20
    mode: str = "async"  # async | sync
    group_size: int = 8  # samples per prompt
    seed: int = 0
    dataset: ReasoningGymConfig = field(default_factory=easy_arithmetic)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reference: ReferenceConfig | None = None  # needed when trainer.loss.kl_coef > 0
    reward: RewardConfig = field(default_factory=RewardConfig)
    buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    provisioner: ProvisionerConfig = field(default_factory=ProvisionerConfig)
    generator_resources: Resources = field(default_factory=Resources)
    trainer_resources: Resources = field(default_factory=Resources)

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be async or sync, got {self.mode!r}")
        if self.buffer.batch_size % self.group_size:
            raise ValueError(
                f"buffer.batch_size {self.buffer.batch_size} must be a multiple of group_size "
                f"{self.group_size}: a batch holds whole groups"
            )
        if self.trainer.loss.kl_coef > 0 and self.reference is None:
            raise ValueError("trainer.loss.kl_coef > 0 needs a reference model config")


class GRPO:
    """The actors of one run and the two loops that drive them."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.version = 0
        self.groups = 0  # groups admitted so far: group k gets prompt k and seed k
        self.stop = asyncio.Event()
        self.busy = _BusyClock()  # time with at least one generate call running
        self.gate = AdmissionGate(cfg.buffer.batch_size, cfg.buffer.max_policy_age, cfg.group_size)
        self.workers: list[asyncio.Future] = []

    async def start(self) -> None:
        cfg = self.cfg
        init_provisioner(cfg.provisioner)
        if cfg.trainer.transport.kind == "torchstore":
            await torchstore_compat.initialize()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a new run, a new curve
        self.trained_log = (self.run_dir / "trained_episodes.jsonl").open("w")
        g, t = cfg.generator_resources, cfg.trainer_resources
        self.generator, self.trainer, self.reward, self.buffer, self.dataset = await asyncio.gather(
            Generator.options(**vars(g)).as_service(cfg.generator),
            TitanTrainer.options(
                procs=t.procs, with_gpus=t.with_gpus, cpus_per_proc=t.cpus_per_proc
            ).as_actor(cfg.trainer),
            RewardActor.as_service(cfg.reward),
            ReplayBuffer.as_actor(cfg.buffer),
            DatasetActor.as_actor(cfg.dataset),
        )
        # A respawned generator replica catches up to the newest weights before taking traffic.
        self.generator.on_recover = lambda actor: actor.load_latest.call()
        self.transport = make_transport(cfg.trainer.transport)
        # Versions an earlier run left behind must not be mistaken for this run's.
        await delete_older_than(self.transport, 2**62)
        # A trainer that resumed a checkpoint is ahead of the generators' base weights.
        self.version = await self.trainer.get_step.call_one()
        if self.version:
            await self.trainer.push_weights.call(self.version)
            await self.generator.update_weights.fanout(self.version)
        self.reference = None
        if cfg.reference is not None:
            self.reference = await ReferenceModel.as_actor(cfg.reference)
        metrics = cfg.metrics
        if metrics.progress_total is None:
            metrics = dataclasses.replace(metrics, progress_total=cfg.steps)
        self.logger = MetricLogger.from_config(
            self.run_dir, metrics, sources=[self.generator, self.trainer, self.reward]
        )

    # --- rollouts -----------------------------------------------------------------------------

    async def rollout(self, group: int) -> list[Episode]:
        """One prompt, G samples, scored and normalised within the group."""
        row = await self.dataset.nth.call_one(group)
        seed = self.cfg.seed * 1_000_003 + group * self.cfg.group_size
        async with self.busy:
            completions = await self.generator.generate.route(
                row["prompt"], n=self.cfg.group_size, sampling={"seed": seed}
            )
        scores = await self.reward.evaluate.route(
            [row] * len(completions), [c.text for c in completions]
        )
        advantages = group_advantages(torch.tensor([s.reward for s in scores]))
        episodes = [
            Episode(f"{group}-{i}", str(group), c, s.reward, s.rewards, float(a))
            for i, (c, s, a) in enumerate(zip(completions, scores, advantages, strict=True))
        ]
        if self.reference is not None:
            pairs = [(c.prompt_ids, c.token_ids) for c in completions]
            for e, lp in zip(episodes, await self.reference.logprobs.call_one(pairs), strict=True):
                e.ref_logprobs = lp
        for s in scores:
            record_metric("rollout/reward", s.reward)
            record_metric("rollout/reward_std", s.reward, Reduce.STD)
            for name, value in s.rewards.items():
                record_metric(f"rollout/reward/{name}", value)
            record_metric("rollout/reward_failures", len(s.failed), Reduce.SUM)
        return episodes

    async def rollout_worker(self) -> None:
        """Starts a rollout whenever the admission gate allows one, until the run stops.

        One failed group is counted and skipped; failures in a row back off, and after
        MAX_FAILURES_IN_A_ROW the run ends with the last error rather than spin.
        """
        failures = 0
        while not self.stop.is_set():
            await self.gate.admit()
            group, self.groups = self.groups, self.groups + 1
            try:
                episodes = await self.rollout(group)
            except Exception as e:
                await self.gate.finished(self.cfg.group_size, kept=0)
                record_metric("rollout/failed_groups", 1, Reduce.SUM)
                failures += 1
                message = str(e).splitlines()[0]
                print(f"rollout of group {group} failed ({failures} in a row): {message}")
                if failures >= MAX_FAILURES_IN_A_ROW:
                    raise RuntimeError(f"{failures} rollouts failed in a row: {message}") from e
                await asyncio.sleep(min(2.0**failures, 30.0))
                continue
            failures = 0
            await self.buffer.add.call_one(episodes)
            await self.gate.finished(len(episodes))

    # --- training -----------------------------------------------------------------------------

    async def train_step(self, step: int) -> dict[str, float]:
        """Waits for a fresh batch, trains on it, and moves every generator to the new weights."""
        waited = time.perf_counter()
        before = await self.buffer.stats.call_one()
        while (batch := await self.buffer.sample.call_one(self.version)) is None:
            _raise_if_failed(self.workers)
            await asyncio.sleep(0.05)
        start = time.perf_counter()
        # Whatever order concurrent groups finished in, train on them in a fixed order.
        batch = [
            sorted(rank, key=lambda e: tuple(map(int, e.episode_id.split("-")))) for rank in batch
        ]
        metrics = await self.trainer.train_step.call_one(batch, policy_version=self.version)
        trained = time.perf_counter()
        self.version += 1
        await self.trainer.push_weights.call(self.version)
        await self.generator.update_weights.fanout(self.version)
        await delete_older_than(self.transport, self.version)
        after = await self.buffer.stats.call_one()
        if self.cfg.mode == "async":  # episodes that left the buffer make room for rollouts
            await self.gate.consumed(_left_buffer(after) - _left_buffer(before))
        self._log_batch(step, batch)
        wall = time.perf_counter() - waited
        for name, value in metrics.items():
            record_metric(f"train/{name}", value)
        record_metric("train/idle_fraction", (start - waited) / wall)
        record_metric("train/step_s", wall)
        record_metric("weights/sync_s", time.perf_counter() - trained)
        record_metric("buffer/size", after["size"])
        record_metric("buffer/evicted_stale", after["evicted_stale"], Reduce.MAX)
        for key in ("policy_age_min", "policy_age_mean", "policy_age_max"):
            record_metric(f"buffer/{key}", after[key] or 0)
        return metrics

    def _log_batch(self, step: int, batch: list[list[Episode]]) -> None:
        episodes = [e for rank in batch for e in rank]
        record = {
            "step": step,
            "trainer_version": self.version - 1,
            "episodes": [e.episode_id for e in episodes],
            "policy_versions": [e.policy_version for e in episodes],
        }
        self.trained_log.write(json.dumps(record) + "\n")
        self.trained_log.flush()

    async def log_step(self, step: int, start: float) -> dict[str, float]:
        for m in self.generator.metrics():
            record_metric("generator/deaths", m["deaths"], Reduce.SUM)
            record_metric("generator/recoveries", m["recoveries"], Reduce.SUM)
        stats = await self.generator.stats.fanout()
        record_metric("generator/tokens_per_s", sum(s["tokens_per_s"] for s in stats))
        record_metric("generator/idle_fraction", self.busy.idle_fraction())
        record_metric("run/elapsed_s", time.perf_counter() - start)
        return await self.logger.step(step)

    # --- the run ------------------------------------------------------------------------------

    async def run(self) -> None:
        start = time.perf_counter()
        if self.cfg.mode == "async":
            ahead = self.gate.limit // self.cfg.group_size
            self.workers = [asyncio.ensure_future(self.rollout_worker()) for _ in range(ahead)]
        try:
            first = self.version + 1  # after a resume, steps continue from the checkpoint
            for step in range(first, first + self.cfg.steps):
                if self.cfg.mode == "sync":
                    await self.sync_rollouts()
                await self.train_step(step)
                await self.log_step(step, start)
        finally:
            self.stop.set()
            for w in self.workers:
                w.cancel()
            await asyncio.gather(*self.workers, return_exceptions=True)

    async def sync_rollouts(self) -> None:
        """Generates exactly one batch, all on the current weights (the synchronous baseline)."""
        start = time.perf_counter()
        groups = self.cfg.buffer.batch_size // self.cfg.group_size
        first, self.groups = self.groups, self.groups + groups
        batches = await asyncio.gather(*(self.rollout(first + g) for g in range(groups)))
        await self.buffer.add.call_one([e for b in batches for e in b])
        record_metric("rollout/batch_s", time.perf_counter() - start)

    async def close(self) -> None:
        """Final checkpoint (if configured), metrics, plot, and every process stopped."""
        try:
            if hasattr(self, "logger"):  # started: there is something to save and show
                if self.cfg.trainer.checkpoint.folder:
                    await self.trainer.save_checkpoint.call()
                self.logger.close()
                self.trained_log.close()
                plot = plot_run(self.run_dir)
                print(f"metrics: {self.run_dir / 'metrics.jsonl'}\nplot: {plot}", flush=True)
        finally:
            await shutdown()


class _BusyClock:
    """Measures the fraction of time with at least one request inside `async with`."""

    def __init__(self) -> None:
        self.inside = 0
        self.busy = 0.0
        self.since = self.start = time.perf_counter()

    async def __aenter__(self) -> None:
        if self.inside == 0:
            self.since = time.perf_counter()
        self.inside += 1

    async def __aexit__(self, *exc: object) -> None:
        self.inside -= 1
        if self.inside == 0:
            self.busy += time.perf_counter() - self.since

    def idle_fraction(self) -> float:
        now = time.perf_counter()
        busy = self.busy + (now - self.since if self.inside else 0.0)
        return 1 - busy / max(now - self.start, 1e-9)


def _left_buffer(stats: dict) -> int:
    return stats["retired"] + stats["evicted_stale"] + stats["evicted_capacity"]


def _raise_if_failed(workers: list[asyncio.Future]) -> None:
    for w in workers:
        if w.done() and not w.cancelled() and w.exception() is not None:
            raise w.exception()


async def main(cfg: Config) -> None:
    grpo = GRPO(cfg)
    try:
        await grpo.start()
        await grpo.run()
    finally:
        await grpo.close()
