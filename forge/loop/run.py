"""Run: the actors every app starts, and what every app does with them.

An app (apps/grpo, apps/distillation, apps/sft) subclasses Run, or RLLoop (forge.loop.rl) for
apps that train on their own generators' samples, and writes only what makes it different:
which extra services it needs (`start_services`) and, for RL, how an episode is scored.

    run = MyApp(cfg)
    await run.main()   # start, run, then close: final eval, checkpoint, export, plot, shutdown

What lives here, once: the provisioner and the run folder; the generator service, the trainer
and the reward service; publishing a new weight version (trainer push -> generator update ->
old versions deleted); held-out evaluation; per-step metrics, progress and plot; the final
checkpoint and the Hugging Face export; stopping every process.
"""

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forge.actors.generator import Generator
from forge.actors.reward import RewardActor
from forge.actors.trainer import TitanTrainer
from forge.controller import init_provisioner, shutdown
from forge.data.datasets import ReasoningGymConfig, ReasoningGymDataset
from forge.data.episode import Episode
from forge.loop.config import Resources, RunConfig
from forge.loop.evaluation import Evaluator
from forge.observability import MetricLogger, Reduce, plot_run, record_metric
from forge.observability.console import say
from forge.weights.transport import delete_older_than, make_transport


class Run:
    """The actors of one run: generators, trainer, reward; subclasses add their own loop.

    Attributes:
        version: the policy version the generators hold (= optimizer steps taken).
        plot_keys: the metrics drawn in run_dir/metrics.png.
    """

    plot_keys: Sequence[str] = ("eval/reward", "train/loss", "generator/tokens_per_s")

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.version = 0
        self.first_step = 1  # after a resume, steps continue from the checkpoint's
        self.evaluator: Evaluator | None = None

    # --- start --------------------------------------------------------------------------------

    async def start(self) -> "Run":
        """Spawns every actor, brings the generators to a resumed trainer's weights; returns
        the run (`run = await GRPO(cfg).start()` in a notebook)."""
        cfg = self.cfg
        self.started = time.perf_counter()
        say(self.summary())
        init_provisioner(cfg.provisioner)
        if cfg.trainer.transport.kind == "torchstore":
            # Imported only here: torchstore prints a warning on import, before any log exists.
            from forge.weights import torchstore_compat

            await torchstore_compat.initialize()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "eval.jsonl"):  # a new run, a new curve
            (self.run_dir / name).unlink(missing_ok=True)
        self.trained_log = (self.run_dir / "trained_episodes.jsonl").open("w")
        g, t = cfg.generator_resources, cfg.trainer_resources
        self.generator, self.trainer, self.reward = await asyncio.gather(
            Generator.options(**vars(g)).as_service(cfg.generator),
            TitanTrainer.options(
                procs=t.procs, with_gpus=t.with_gpus, cpus_per_proc=t.cpus_per_proc, env=t.env
            ).as_actor(cfg.trainer),
            RewardActor.as_service(cfg.reward),
        )
        # A respawned generator replica catches up to the newest weights before taking traffic.
        self.generator.on_recover = lambda actor: actor.load_latest.call()
        sources = [self.generator, self.trainer, self.reward, *await self.start_services()]
        self.transport = make_transport(cfg.trainer.transport)
        # Versions an earlier run left behind must not be mistaken for this run's.
        await self.transport.clear()
        # A trainer that resumed a checkpoint is ahead of the generators' base weights.
        self.world = self.cfg.trainer_resources.procs  # data-parallel ranks (one host)
        self.version = (await self.trainer.get_step.call()).item(procs=0)
        self.first_step = self.version + 1
        if self.version:
            await self.trainer.push_weights.call(self.version)
            await self.generator.update_weights.fanout(self.version)
        metrics = cfg.metrics
        if metrics.progress_total is None:
            metrics = dataclasses.replace(metrics, progress_total=cfg.steps)
        self.logger = MetricLogger.from_config(self.run_dir, metrics, sources=sources)
        if cfg.eval.interval:
            rows = self.eval_rows()
            self.evaluator = Evaluator(
                rows, self.generator, self.reward, cfg.eval.max_tokens, self.run_dir / "eval.jsonl"
            )
            self.evaluator.start(0, self.version)  # the starting point, to compare against
        return self

    def summary(self) -> str:
        """The start-up line: what trains, on which processes, where the run is written."""
        g, t = self.cfg.generator_resources, self.cfg.trainer_resources
        return (
            f"{type(self).__name__}: {self.cfg.trainer.model}, {self.cfg.steps} steps | "
            f"generator {_placement(g)} | trainer {_placement(t)} | run folder {self.run_dir}"
        )

    async def start_services(self) -> list[Any]:
        """Spawns the app's own actors; returns those whose metrics the logger should pull."""
        return []

    def eval_rows(self) -> list[dict]:
        """The held-out rows: `eval.dataset`, else the training task under another seed."""
        e = self.cfg.eval
        dataset = e.dataset or dataclasses.replace(self.training_task(), seed=e.seed)
        source = ReasoningGymDataset(dataset)
        return [source.nth(i) for i in range(e.size)]

    def training_task(self) -> ReasoningGymConfig:
        """The training task, which held-out rows default to (with another seed)."""
        raise NotImplementedError(f"{type(self).__name__}: set eval.dataset")

    # --- each step ----------------------------------------------------------------------------

    async def train(self, batches: list[list[Episode]], **kwargs: Any) -> dict[str, float]:
        """One optimizer step, `batches[r]` on data-parallel rank r; the trainer's metrics,
        also recorded under train/."""
        metrics = (await self.trainer.train_step.call(batches, **kwargs)).item(procs=0)
        self.version += 1
        for name, value in metrics.items():
            record_metric(f"train/{name}", value)
        return metrics

    async def publish(self, step: int) -> None:
        """The trainer's weights, as `version`, to every generator; older versions deleted."""
        start = time.perf_counter()
        await self.trainer.push_weights.call(self.version)
        await self.generator.update_weights.fanout(self.version)
        await delete_older_than(self.transport, self.version)
        record_metric("weights/sync_s", time.perf_counter() - start)
        if self.evaluator is not None and self._eval_due(step):
            self.evaluator.start(step, self.version)

    def _eval_due(self, step: int) -> bool:
        return step % self.cfg.eval.interval == 0 or step == self.last_step

    @property
    def last_step(self) -> int:
        return self.first_step + self.cfg.steps - 1

    async def log_step(self, step: int, start: float) -> dict[str, float]:
        """Generator health and throughput, then every process's metrics of `step`."""
        if step == self.last_step and self.evaluator is not None:
            await self.evaluator.wait()  # the final eval belongs to the last step's line
        for m in self.generator.metrics():
            record_metric("generator/deaths", m["deaths"], Reduce.SUM)
            record_metric("generator/recoveries", m["recoveries"], Reduce.SUM)
        stats = await self.generator.stats.fanout()
        record_metric("generator/tokens_per_s", sum(s["tokens_per_s"] for s in stats))
        record_metric("run/elapsed_s", time.perf_counter() - start)
        return await self.logger.step(step)

    def log_batch(self, step: int, version: int, batch: list[list[Episode]]) -> None:
        """Appends which episodes (and of which versions) trained at `step` on weights
        `version`."""
        episodes = [e for rank in batch for e in rank]
        record = {
            "step": step,
            "trainer_version": version,
            "episodes": [e.episode_id for e in episodes],
            "policy_versions": [e.policy_version for e in episodes],
        }
        self.trained_log.write(json.dumps(record) + "\n")
        self.trained_log.flush()

    # --- the run ------------------------------------------------------------------------------

    async def run(self) -> None:
        """The app's loop over steps `first_step .. last_step`."""
        raise NotImplementedError

    async def main(self) -> None:
        """Start, run, and always close."""
        try:
            await self.start()
            await self.run()
        finally:
            await self.close()

    async def close(self) -> None:
        """Final checkpoint (if configured), HF export, metrics, plot; every process stopped."""
        try:
            if hasattr(self, "logger"):  # started: there is something to save and show
                self.logger.close()  # the progress bar first, so the lines below stay whole
                self.trained_log.close()
                if self.cfg.trainer.checkpoint.folder:
                    await self.trainer.save_checkpoint.call()
                    say(f"checkpoint: {self.cfg.trainer.checkpoint.folder}")
                if self.cfg.export_hf:
                    export = self.run_dir / "hf"
                    await self.trainer.export_hf.call(str(export))
                    say(f"model: {export}")
                metrics = self.run_dir / "metrics.jsonl"
                if (
                    metrics.exists() and metrics.stat().st_size
                ):  # a run that failed at once has none
                    say(f"metrics: {metrics}\nplot: {plot_run(self.run_dir, self.plot_keys)}")
        finally:
            try:
                if hasattr(self, "transport"):  # shared memory is the machine's, not the run's
                    await self.transport.clear()
            finally:
                await shutdown()


def _placement(r: Resources) -> str:
    """`2 replicas x 1 proc (1 core each)`, `2 procs (GPUs)`, `1 proc (any core)`."""
    cores = f"{r.cpus_per_proc} core{'s' if r.cpus_per_proc > 1 else ''} each"
    where = "GPUs" if r.with_gpus else cores if r.cpus_per_proc else "any core"
    replicas = f"{r.num_replicas} replicas x " if r.num_replicas > 1 else ""
    return f"{replicas}{r.procs} proc{'s' if r.procs > 1 else ''} ({where})"
