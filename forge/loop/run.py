"""Run: the actors every app starts, and what every app does with them.

An app (apps/grpo, apps/distillation, apps/sft) subclasses Run, or RLLoop (forge.loop.rl) for
apps that train on their own generators' samples, and writes only what makes it different:
the roles it adds (its config's `roles()`, whose handles it takes in `attach`) and, for RL, how
an episode is scored.

    run = MyApp(cfg)
    await run.main()   # start, run, then close: final eval, checkpoint, export, plot, shutdown

What lives here, once: the provisioner and the run folder; starting the config's roles (the
trainer, and the generator and reward services where the run needs them); publishing a new
weight version (trainer push -> generator update -> old versions deleted); held-out evaluation;
per-step metrics, progress and plot; the final checkpoint and the Hugging Face export; stopping
every process.
"""

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forge.config import config_error
from forge.controller import get_provisioner, init_provisioner, shutdown
from forge.data.chat import ChatBridge
from forge.data.datasets import PromptDataset, open_dataset
from forge.data.episode import Episode
from forge.data.rewards import check_columns, resolve_reward
from forge.loop.config import RunConfig
from forge.loop.episodes import Episodes
from forge.loop.evaluation import EvalRows, Evaluator, eval_rows
from forge.loop.generator_handle import GeneratorHandle
from forge.loop.plan import plan_run
from forge.loop.record import BatchRecord, StepRecord
from forge.loop.replay import ReplayError, replay_steps
from forge.loop.run_folder import RunFinished, RunFolder
from forge.loop.spawn import spawn_role, spawn_roles
from forge.loop.trainer_handle import TrainerDied, TrainerHandle
from forge.observability import (
    MetricLogger,
    Reduce,
    drain_local,
    plot_run,
    plot_timeline,
    record_metric,
)
from forge.observability.console import say
from forge.placement.placer import Placer
from forge.placement.plan import GROUP
from forge.weights.shm_folders import claim_for_run
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
        self.folder = RunFolder(cfg.run_dir, cfg.trainer.checkpoint.folder)
        self.record = BatchRecord(cfg.run_dir, cfg.record)
        self.version = 0
        self.logged = 0  # the newest step whose metrics are logged: the newest step finished
        self.trainer_restarts = 0
        self.checkpointed = 0  # the step of the newest checkpoint
        self.stopped_at = 0  # the step the divergence guard stopped the run at
        self.evaluator: Evaluator | None = None
        # Whether generators may move to new weights while the trainer takes its next step
        # (data one version older meanwhile); set by loops whose batches may be that old.
        self.overlap_updates = False
        self._update: asyncio.Future | None = None  # that move, while it runs

    # --- start --------------------------------------------------------------------------------

    async def start(self) -> "Run":
        """Spawns every actor and, when the run folder holds a checkpoint, continues from it;
        returns the run (`run = await GRPO(cfg).start()` in a notebook).

        Raises RunFinished (before anything starts) if the folder's run took `steps` already.
        """
        cfg = self.cfg
        # An impossible placement, data that cannot be read, a reward the data cannot feed:
        # each fails here, before the folder or a process.
        self.plan = plan_run(cfg)
        self.data, self.held_out = self.open_data()
        self.placer = Placer(self.plan, say, self.run_dir / "pipeline.json")
        resumed = self.checkpointed = self.folder.open(cfg, cfg.resume)
        self.folder.rewind(resumed)
        self.started = time.perf_counter()
        say(self.summary() + (f" | resuming at step {resumed}" if resumed else ""))
        init_provisioner(cfg.provisioner)
        if self.plan.group is not None:  # first, as the plan placed it
            g = self.plan.group
            await get_provisioner().reserve_group(
                GROUP, hosts=len(g.hosts), gpus=len(g.gpus[0]), cpus=len(g.cpus[0])
            )
        # Its /dev/shm folder, given back at shutdown(), holds an shm transport left unset.
        claim_for_run(self.run_dir, cfg.weight_sync.transport)
        if cfg.weight_sync.transport.kind in ("rdma", "torchstore"):  # rdma: handles, manifests
            # Imported only here: torchstore prints a warning on import, before any log exists.
            from forge.weights import torchstore_compat

            await torchstore_compat.initialize()
        self.trained_log = (self.run_dir / "trained_episodes.jsonl").open("a")
        self.timeline_log = (self.run_dir / "timeline.jsonl").open("a")
        # The episodes' chat bridge needs the generators' tokenizer: loaded while they start.
        generates = cfg.generates()
        if generates:
            tokenizer = asyncio.ensure_future(
                asyncio.to_thread(load_tokenizer, cfg.generator.model)
            )
        actors = await spawn_roles(self.plan.roles)
        # The handles take the colocated turns: no caller can forget them.
        self.trainer = TrainerHandle(actors["trainer"], self.placer.turns)
        self.generator: GeneratorHandle | None = None
        self.reward = actors.get("reward")
        if generates:
            self.generator = GeneratorHandle(actors["generator"], self.placer.turns)
            self.generator.service.on_recover = self.recover_generator
            self.episodes = Episodes(
                cfg.env,
                self.generator,
                ChatBridge(await tokenizer),
                cfg.generator.sampling.max_tokens,
                cfg.generator.max_model_len,
                actors.get("environment"),
                self.reward,
            )
        await self.attach(actors)
        sources = list(actors.values())  # every role's actors: the trainer's mesh too
        # Which hosts each role's processes landed on, for the user (and tests) to check.
        placement = [{"mesh": m, "hosts": h} for m, h in get_provisioner().placements()]
        (self.run_dir / "placement.json").write_text(json.dumps(placement, indent=1) + "\n")
        self.transport = make_transport(cfg.weight_sync.transport)
        # Versions an earlier run left behind must not be mistaken for this run's.
        await self.transport.clear()
        t = cfg.trainer_resources
        self.world = t.procs * (t.hosts or 1)  # data-parallel ranks
        # The trainer resumed the same checkpoint; the generators start from its weights.
        self.version = self.logged = await self.trainer.get_step()
        if self.version != resumed:
            raise RuntimeError(f"trainer resumed step {self.version}, the run folder {resumed}")
        if resumed:
            await self.load_state_dict(self.folder.load_driver_state(resumed) or {})
            await self.sync_generators()
        metrics = cfg.metrics
        if metrics.progress_total is None:
            metrics = dataclasses.replace(metrics, progress_total=cfg.steps)
        self.logger = MetricLogger.from_config(self.run_dir, metrics, sources=sources)
        await self.fit_placement()
        say(self.placer.line())
        if self.held_out is not None:
            self.evaluator = Evaluator(
                self.held_out.rows, self.episodes, cfg.eval.max_tokens, self.run_dir / "eval.jsonl"
            )
            self.held_out.write(self.run_dir / "eval_rows.jsonl")
            if not resumed:
                self.evaluator.start(0, self.version)  # the starting point, to compare against
        return self

    async def recover_generator(self, actor: Any) -> None:
        """A respawned generator replica catches up to the newest weights, and to the cores
        its placement moved it to, before taking traffic."""
        await actor.load_latest.call()
        if (cpus := self.placer.cores_of("generator")) is not None:
            await actor.use_cores.call(cpus)

    async def fit_placement(self) -> None:
        """Settles where generator and trainer run once both are up, before the first eval;
        loops that measure and move them override it (forge.loop.rl: `Placer.fit`)."""

    def summary(self) -> str:
        """The start-up line, said before anything starts: what trains on which rows, where
        the run is written."""
        skipped = len(self.data.skipped)
        data = f"data {self.data.name}, {len(self.data)} rows" + (
            f" ({skipped} malformed skipped)" if skipped else ""
        )
        held_out = f" | eval {self.held_out.description}" if self.held_out else ""
        return (
            f"{type(self).__name__}: {self.cfg.trainer.model}, {self.cfg.steps} steps | {data}"
            f"{held_out} | run folder {self.run_dir}"
        )

    def open_data(self) -> tuple[PromptDataset, EvalRows | None]:
        """The training rows and the eval rows, checked against the reward functions' columns.

        Raises:
            ConfigError: a source cannot be read, a row is malformed, a reward function cannot
                be imported or reads a column the data lacks; one line naming it.
        """
        cfg = self.cfg
        with config_error("data"):
            data = open_dataset(cfg.data, cfg.eval.hold_out())
        with config_error("eval"):
            held_out = eval_rows(cfg.eval, cfg.data, data) if cfg.eval.interval else None
        if cfg.generates():
            with config_error("env.factory"):
                cfg.env.resolve()  # a name that does not import fails before any process
        with config_error("reward.functions"):
            functions = {name: resolve_reward(name) for name in cfg.reward.functions}
            check_columns(functions, data.name, data.columns)
            if held_out is not None:
                check_columns(functions, held_out.source, held_out.columns)
        return data, held_out

    async def attach(self, actors: dict[str, Any]) -> None:
        """Takes the handles of the app's own roles (`RunConfig.roles()`) from `actors`, by
        role name, once every role has started; the app's other start-up goes here too."""

    # --- each step ----------------------------------------------------------------------------

    async def train(
        self, batches: list[list[Episode]], policy_version: int | None = None
    ) -> dict[str, float]:
        """One optimizer step, `batches[r]` on data-parallel rank r; the trainer's metrics,
        also recorded under train/. The batch goes to the run's batch record (`record`)."""
        recording = self.record.enabled
        start = time.perf_counter()
        metrics = await self.trainer.train_step(batches, policy_version, record=recording)
        record_metric("train/call_s", time.perf_counter() - start)
        self.version += 1
        self.log_span(
            self.version, "trainer", "train", metrics.pop("started_at"), metrics.pop("ended_at")
        )
        blown = metrics.pop("blown")
        if recording:
            step = StepRecord(self.version, policy_version, batches, **metrics.pop("record"))
            step.figures.update(metrics)
            start = time.perf_counter()
            size = await asyncio.to_thread(self.record.write, step)
            record_metric("record/write_s", time.perf_counter() - start)
            record_metric("record/bytes", size)
        for name, value in metrics.items():
            record_metric(f"train/{name}", value)
        if blown is not None:
            self.blew_up(self.version, blown)
        return metrics

    def blew_up(self, step: int, why: str) -> None:
        """Says that the divergence guard did not apply `step`, and how to replay it; raises
        if the guard's action is to stop (the run then writes no final checkpoint: resumed,
        it takes the step again)."""
        action = self.cfg.trainer.guard.action
        say(f"step {step} not applied: {why} (trainer.guard.action {action}); {self._replay(step)}")
        if action == "stop":
            self.stopped_at = step
            raise RuntimeError(f"the divergence guard stopped the run at step {step}")

    def _replay(self, step: int) -> str:
        """The command that replays `step`, or why there is none."""
        if not self.record.enabled:
            return "record.batches is off: it cannot be replayed"
        try:
            replay_steps(self.record, self.folder.checkpoints, step)
        except ReplayError as e:
            return f"it cannot be replayed: {e}"
        return f"replay it: forge replay {self.run_dir} --step {step}"

    async def publish(self, step: int) -> float:
        """The trainer's weights, as `version`, to every generator; older versions deleted.
        Returns the seconds the trainer spent publishing them.

        With `overlap_updates` the generators move in the background while the trainer takes
        its next step; the next publish waits for that move first, so at most two versions
        exist. `weights/sync_s` is what the loop waited.
        """
        start = time.perf_counter()
        await self.wait_for_update()
        pushing = time.perf_counter()
        published = await self.trainer.push_weights(self.version)
        pushed = time.perf_counter()
        record_metric("weights/push_s", pushed - pushing)
        record_metric("weights/bytes", published["bytes"])
        update = self._update_generators(step, self.version)
        if self.overlap_updates:
            self._update = asyncio.ensure_future(update)
        else:
            await update
        record_metric("weights/sync_s", time.perf_counter() - start)
        return pushed - pushing

    async def _update_generators(self, step: int, version: int) -> None:
        start = time.perf_counter()
        updates = await self.generator.update_weights(version)
        record_metric("weights/update_s", time.perf_counter() - start)
        if not updates:  # every generator died meanwhile (a respawn loads the newest version)
            return
        # Per generator: the version built beside the live weights (generation goes on), the
        # drain before its swap (nothing new admitted), then the swap (engine stopped); the
        # slowest generator's.
        for phase in ("prepare", "pause", "swap"):
            record_metric(f"weights/generator_{phase}_s", max(u[f"{phase}_s"] for u in updates))
        for i, u in enumerate(updates):
            if u["mode"] != "none":
                self.log_span(step, f"generator {i}", "prepare", u["prepare_at"], u["pause_at"])
                self.log_span(step, f"generator {i}", "pause", u["pause_at"], u["swap_at"])
                self.log_span(step, f"generator {i}", "swap", u["swap_at"], u["end_at"])
        await delete_older_than(self.transport, version)
        if self.evaluator is not None and self._eval_due(step):
            self.evaluator.start(step, version)

    async def wait_for_update(self) -> None:
        """Returns once the generators' move to the last published version is over (raising
        its error, if it failed)."""
        if self._update is not None:
            update, self._update = self._update, None
            await update

    async def sync_generators(self) -> None:
        """Moves every generator to the trainer's weights, even back to an older version (a
        restarted trainer); every other version is deleted."""
        if self.generator is None:
            return
        await self.wait_for_update()
        await self.trainer.push_weights(self.version)
        await self.generator.update_weights(self.version)
        for version in await self.transport.versions():
            if version != self.version:
                await self.transport.delete(version)

    async def checkpoint(self, step: int, final: bool = False) -> None:
        """Checkpoint `step` if one is due (or `final`): the driver's state, then the trainer's.

        The trainer's write goes on in the background (checkpoint.async_save) except at the
        end; `checkpoint/blocked_s` is what it cost the loop.
        """
        ckpt = self.cfg.trainer.checkpoint
        if ckpt.folder is None or not (final or (ckpt.interval and step % ckpt.interval == 0)):
            return
        start = time.perf_counter()
        self.folder.save_driver_state(step, await self.state_dict())
        if self.checkpointed == step:  # the trainer's part is written (or being written)
            await self.trainer.wait_checkpoint()
        else:
            await self.trainer.save_checkpoint(background=False if final else None)
        self.checkpointed = step
        record_metric("checkpoint/blocked_s", time.perf_counter() - start)

    async def state_dict(self) -> dict[str, Any]:
        """What the driver needs to continue from a checkpoint (the app's data position)."""
        return {}

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""

    async def restart_trainer(self, error: TrainerDied) -> None:
        """Respawns a dead trainer from its newest checkpoint and moves the generators to its
        weights; the steps after that checkpoint are taken again.

        Raises:
            RuntimeError: the trainer died more than `max_trainer_restarts` times.
            HostLostError: its host is gone, so it cannot be respawned there.
        """
        await get_provisioner().check_hosts(self.trainer.mesh)
        self.trainer_restarts += 1
        if self.trainer_restarts > self.cfg.max_trainer_restarts:
            raise RuntimeError(
                f"{error}; not restarted: it died {self.trainer_restarts} times "
                f"(max_trainer_restarts {self.cfg.max_trainer_restarts})"
            ) from error
        start, died_at = time.perf_counter(), self.version
        old = self.trainer.mesh
        await get_provisioner().stop_actor(old)
        self.trainer = TrainerHandle(await spawn_role(self.plan.role("trainer")), self.placer.turns)
        if (cpus := self.placer.cores_of("trainer")) is not None:
            await self.trainer.use_cores(cpus)
        self.logger.sources = [self.trainer.mesh if s is old else s for s in self.logger.sources]
        self.version = self.checkpointed = self.logged = await self.trainer.get_step()
        await self.sync_generators()
        self.folder.rewind(self.version)  # the steps after the checkpoint are redone
        record_metric("trainer/restarts", self.trainer_restarts, Reduce.MAX)
        record_metric("trainer/redone_steps", died_at - self.version, Reduce.SUM)
        record_metric("trainer/restart_s", time.perf_counter() - start)
        redo = died_at - self.version
        say(
            f"{error}; restarted from the checkpoint of step {self.version} in "
            f"{time.perf_counter() - start:.0f}s ({redo} step{'s' * (redo != 1)} to redo)"
        )

    def _eval_due(self, step: int) -> bool:
        return step % self.cfg.eval.interval == 0 or step == self.last_step

    @property
    def last_step(self) -> int:
        """The run's last step: `steps` is its total, resumes included."""
        return self.cfg.steps

    async def log_step(self, step: int, start: float) -> dict[str, float]:
        """Generator health and throughput (if the run has generators), then every process's
        metrics of `step`."""
        if step == self.last_step:
            await self.wait_for_update()  # it starts the final eval
            if self.evaluator is not None:
                await self.evaluator.wait()  # the final eval belongs to the last step's line
        if self.generator is not None:
            await self.log_generators(step)
        record_metric("run/elapsed_s", time.perf_counter() - start)
        logged = await self.logger.step(step)
        self.logged = step
        return logged

    async def log_generators(self, step: int) -> None:
        """The generators' deaths, throughput, and busy intervals (on the timeline)."""
        for m in self.generator.metrics():
            record_metric("generator/deaths", m["deaths"], Reduce.SUM)
            record_metric("generator/recoveries", m["recoveries"], Reduce.SUM)
            record_metric("generator/hangs", m["hangs"], Reduce.SUM)
        stats = await self.generator.stats()
        record_metric("generator/tokens_per_s", sum(s["tokens_per_s"] for s in stats))
        for i, spans in enumerate(await self.generator.busy_spans()):
            for purpose, begin, end in spans:
                self.log_span(step, f"generator {i}", _BUSY[purpose], begin, end)

    def log_batch(self, step: int, version: int, batch: list[list[Episode]]) -> None:
        """Appends which episodes (and of which versions) trained at `step` on weights
        `version`."""
        episodes = [e for rank in batch for e in rank]
        record = {
            "step": step,
            "trainer_version": version,
            "episodes": [e.episode_id for e in episodes],
            "rows": [e.row for e in episodes],
            "policy_versions": [e.policy_version for e in episodes],
            "turns": [e.completion.metadata.get("turns", 1) for e in episodes],
        }
        self.trained_log.write(json.dumps(record) + "\n")
        self.trained_log.flush()

    def log_span(self, step: int, lane: str, what: str, start: float, end: float) -> None:
        """Appends an interval to the run's timeline (forge.observability.timeline)."""
        span = {"step": step, "lane": lane, "what": what, "start": start, "end": end}
        self.timeline_log.write(json.dumps(span) + "\n")
        self.timeline_log.flush()

    # --- the run ------------------------------------------------------------------------------

    async def run(self) -> None:
        """The app's loop: steps `version + 1 .. last_step`."""
        raise NotImplementedError

    async def main(self) -> None:
        """Start, run, and always close; a finished run says so and does nothing."""
        try:
            await self.start()
            await self.run()
        except RunFinished as e:  # raised before anything started
            say(str(e))
        finally:
            await self.close()

    async def close(self) -> None:
        """Final checkpoint (if configured), HF export, metrics, plot; every process stopped."""
        try:
            if hasattr(self, "logger"):  # started: there is something to save and show
                await self._settle_update()
                await self._log_interrupted_step()
                drain_local()  # what a last update recorded belongs to no logged step
                self.logger.close()  # the progress bar first, so the lines below stay whole
                self.trained_log.close()
                self.timeline_log.close()
                await self.save_results()
                metrics = self.run_dir / "metrics.jsonl"
                if metrics.exists() and metrics.stat().st_size:  # a failed start logs none
                    say(f"metrics: {metrics}\nplot: {plot_run(self.run_dir, self.plot_keys)}")
                    if timeline := plot_timeline(self.run_dir):
                        say(f"timeline: {timeline}")
        finally:
            try:
                if hasattr(self, "transport"):  # shared memory is the machine's, not the run's
                    await self.transport.clear()
            finally:
                await shutdown()

    async def _log_interrupted_step(self) -> None:
        """Logs a step that trained but was stopped before its line (Ctrl-C, or a failure in
        its weight update), so that the final checkpoint is of a step the metrics show. A step
        the divergence guard stopped the run at said so already, and gets no checkpoint."""
        if self.version == self.logged or self.stopped_at:
            return
        try:
            await self.log_step(self.version, self.started)
        except Exception as e:
            say(f"step {self.version} trained, but its metrics could not be logged: {e}")

    async def _settle_update(self) -> None:
        """Waits for a running weight update at close; a failed one is reported, not raised
        (the run's own error, if any, is the one to see)."""
        try:
            await self.wait_for_update()
        except Exception as e:
            say(f"the last weight update failed: {e}")

    async def save_results(self) -> None:
        """The final checkpoint and the HF export; a dead trainer has nothing left to save."""
        try:
            if self.stopped_at:
                say(f"no final checkpoint: resumed, it goes on after step {self.checkpointed}")
            elif self.version != self.logged:  # resumed from there, its line would be missing
                say(f"no final checkpoint: step {self.version} was not logged")
            elif self.cfg.trainer.checkpoint.folder and self.version:
                await self.checkpoint(self.version, final=True)
                say(f"checkpoint: {self.cfg.trainer.checkpoint.folder} (step {self.version})")
            if self.cfg.export_hf:
                export = self.run_dir / "hf"
                await self.trainer.export_hf(str(export))
                lora = self.cfg.weight_sync.lora
                say(f"{'adapter' if lora else 'model'}: {export}")
                if lora and self.cfg.export_merged:
                    merged = self.run_dir / "hf-merged"
                    await self.trainer.export_hf(str(merged), merged=True)
                    say(f"merged model: {merged}")
        except TrainerDied as e:
            say(f"{e}: no final checkpoint or export")


def load_tokenizer(model: str) -> Any:
    """The Hugging Face tokenizer of `model` (a name forge.models resolves, or a folder)."""
    from transformers import AutoTokenizer  # seconds to import: a thread's work, off the loop

    from forge.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))


# A generator's busy intervals on the timeline, by the purpose of its calls.
_BUSY = {"rollout": "generate", "eval": "eval"}
