"""The config fields every app shares: where the run lives, its actors, their placement, eval."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from forge.actors.buffer import ReplayBuffer, ReplayBufferConfig
from forge.actors.dataset import DatasetActor
from forge.actors.environment import EnvironmentActor
from forge.actors.generator import Generator, GeneratorConfig
from forge.actors.reward import RewardActor, RewardConfig
from forge.actors.trainer import TitanTrainer, TrainerConfig
from forge.config import at_least
from forge.controller import ProvisionerConfig
from forge.data.datasets import DataConfig
from forge.envs.config import EnvConfig
from forge.loop.control_door import ControlConfig
from forge.loop.record.batches import RecordConfig
from forge.loop.run_folder import CHECKPOINTS
from forge.loop.stop_signals import ShutdownConfig
from forge.losses import ObjectiveName
from forge.observability import MetricsConfig
from forge.placement.plan import PlacementChoice
from forge.placement.roles import Resources, Role
from forge.weights.sync_config import WeightSyncConfig

# How an RL run interleaves rollouts and training (RLConfig.mode).
Mode = Literal["async", "sync"]


def overlaps(mode: Mode, max_policy_age: int) -> bool:
    """Whether a batch may be generated while the one before trains: async, with batches
    allowed to be a version old."""
    return mode == "async" and max_policy_age >= 1


@dataclass
class EvalConfig:
    """Held-out evaluation: the generators answer a fixed set of rows greedily, and the reward
    functions score the answers.

    The rows: by default `size` rows held out of the training source (`data`): a seeded sample
    that is never trained on. `fraction` holds out that share of the source instead, `size` of
    them evaluated. `split` evaluates `size` rows of another split of the same source, `data`
    of another source; neither holds anything out.

    Args:
        interval: evaluate every `interval` steps (and before the first and after the last);
            0 turns eval off (and holds nothing out).
        size: rows evaluated.
        fraction: the share of the training source held out, in (0, 1); None: `size` rows.
        split: a split of the training source to evaluate on (local folders with splits, hf).
        data: another source to evaluate on.
        max_tokens: generation budget per answer.
    """

    interval: int = 0
    size: int = 64
    fraction: float | None = None
    split: str | None = None
    data: DataConfig | None = None
    max_tokens: int = 32

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "dataset": "renamed to eval.data",
        "seed": "removed: eval rows are held out of data (eval.size, eval.fraction), or read "
        "from eval.split or eval.data",
    }

    def __post_init__(self) -> None:
        at_least(self, 1, "max_tokens")
        if self.interval < 0 or self.size < 1:
            raise ValueError(f"need interval >= 0 and size >= 1, got {self.interval}, {self.size}")
        chosen = [k for k in ("fraction", "split", "data") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(f"set one of fraction, split and data, not {' and '.join(chosen)}")
        if self.fraction is not None and not 0 < self.fraction < 1:
            raise ValueError(f"fraction must lie in (0, 1), got {self.fraction}")

    def hold_out(self) -> int | float:
        """What the training source keeps apart for eval: a count, a fraction, or 0."""
        if not self.interval or self.split is not None or self.data is not None:
            return 0
        return self.fraction if self.fraction is not None else self.size


@dataclass
class RunConfig:
    """What every app's config holds; an app's own Config subclasses it (or RLConfig).

    The trainer's objective is the app's (`OBJECTIVE`), and its checkpoints go into
    run_dir/checkpoints (`trainer.checkpoint.enabled`): `__post_init__` fills both in.

    Args:
        run_dir: the run's folder: its config, metrics, plot, trained-episode log, checkpoints,
            export. It identifies the run (forge/loop/run_folder.py).
        steps: the run's total optimizer steps; a resumed run continues up to it.
        data: the training rows (docs/data.md); eval holds its rows out of them.
        resume: continue the run in `run_dir` from its newest checkpoint; false refuses a
            folder that holds a run.
        max_trainer_restarts: how many times a dead trainer is respawned from its checkpoint
            before the run fails.
        seed: seeds the run's sampling (each group's generation seed) and the SFT app's batch
            order.
        export_hf: write the trained model as a Hugging Face folder (run_dir/hf) at the end;
            with weight_sync.lora, the adapter as a PEFT folder.
        export_merged: with weight_sync.lora and export_hf, also write the model with the adapter
            folded in, as a Hugging Face folder (run_dir/hf-merged).
        placement: where generator and trainer run (docs/placement.md). "split": each on
            devices of its own (generator_resources, trainer_resources), overlapping in async
            mode. "colocated": both on the same devices, taking turns, each using all of
            them while it runs. "auto": on one CPU host, colocated processes that a short
            calibration then gives all the cores in turn or splits between them, whichever
            the pipeline model predicts faster; elsewhere "split".
        generator: the vLLM engines: model, context, KV cache, sampling defaults, update mode.
        trainer: the trained model, its optimizer, schedule, loss and checkpoints.
        weight_sync: what a published version holds (dtype, LoRA adapters or full weights)
            and how it travels: one section, given to the trainer and to the generators.
        reward: the reward functions that score answers.
        env: the environment every rollout and eval answer is an episode of
            (docs/environments.md); by default the single-turn task.
        eval: the held-out evaluation: which rows, how often.
        metrics: where the run's metrics go besides run_dir/metrics.jsonl.
        record: which steps' batches the run folder keeps for `forge replay`
            (docs/run_folder.md).
        provisioner: the hosts the run's processes start on (local, emulated or SLURM nodes).
        generator_resources: the generators' processes and devices.
        trainer_resources: the trainer's processes and devices; its ranks are procs x hosts.
        env_resources: unset: the environments live in the loop's process (for tasks whose
            steps are quick and never block); set: in an EnvironmentActor service of
            `num_replicas` replicas, where tool calls run; a replica that dies is respawned and
            its episodes are played again from their first turn.
        shutdown: how the run ends when stopped with SIGTERM, SIGHUP or SIGUSR1 (as after
            Ctrl-C, within a grace period).
    """

    run_dir: str = "runs/forge"
    steps: int = 20
    data: DataConfig = field(default_factory=DataConfig)
    resume: bool = True
    max_trainer_restarts: int = 2
    seed: int = 0
    export_hf: bool = True
    export_merged: bool = False
    placement: PlacementChoice = "auto"
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    record: RecordConfig = field(default_factory=RecordConfig)
    provisioner: ProvisionerConfig = field(default_factory=ProvisionerConfig)
    generator_resources: Resources = field(default_factory=Resources)
    trainer_resources: Resources = field(default_factory=Resources)
    env_resources: Resources | None = None
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "dataset": "renamed to data (one data section for every app: docs/data.md)"
    }
    # The trainer's objective (trainer.objective): the app's, set by its Config. None here:
    # a run folder's saved config, read as RunConfig (forge replay), keeps the one it ran with.
    OBJECTIVE: ClassVar[ObjectiveName | None] = None
    # Whether the reward functions score every rollout's answer (GRPO), or only eval answers.
    REWARDS_ROLLOUTS: ClassVar[bool] = False

    def __post_init__(self) -> None:
        at_least(self, 1, "steps")
        at_least(self, 0, "max_trainer_restarts")
        if self.OBJECTIVE is not None:
            self.trainer.objective = self.OBJECTIVE
        checkpoint = self.trainer.checkpoint
        checkpoint.folder = str(Path(self.run_dir) / CHECKPOINTS) if checkpoint.enabled else None

    @property
    def trainer_ranks(self) -> int:
        """The trainer's data-parallel ranks: procs x hosts, each trains an equal share."""
        return self.trainer_resources.procs * (self.trainer_resources.hosts or 1)

    def roles(self) -> list[Role]:
        """The run's roles, in placement order: the trainer; the generators (and the
        environment service, with `env_resources`) and the reward service where the run
        generates and scores (`generates`, `scores`). Apps add theirs after these."""
        t = self.trainer_resources
        sync = self.weight_sync  # one object for both: they cannot disagree
        roles = [Role("trainer", TitanTrainer, (self.trainer, sync), t, "trainer_resources")]
        if self.generates():
            g, args = self.generator_resources, (self.generator, sync)
            roles.append(Role("generator", Generator, args, g, "generator_resources", True))
            if (envs := self.env_resources) is not None:
                args = (self.env,)
                roles.append(
                    Role("environment", EnvironmentActor, args, envs, "env_resources", True)
                )
        if self.scores():
            roles.append(Role("reward", RewardActor, (self.reward,), service=True))
        return roles

    def generates(self) -> bool:
        """Whether the run needs generators: here, for the held-out eval only."""
        return self.eval.interval > 0

    def scores(self) -> bool:
        """Whether the run needs the reward service: where reward functions are named (an
        environment may reward on its own), for the rollouts (`REWARDS_ROLLOUTS`) or the eval."""
        return bool(self.reward.functions) and (self.REWARDS_ROLLOUTS or self.eval.interval > 0)


@dataclass
class RLConfig(RunConfig):
    """An app that trains on its own generators' samples (GRPO, on-policy distillation).

    Args:
        mode: "async" (rollouts and training overlap, bounded by buffer.max_policy_age) or
            "sync" (generate a batch, then train on it).
        group_size: samples per prompt.
        buffer: the replay buffer; `__post_init__` fills in its dp_size, the trainer's ranks.
        control: where the run's live control listens (docs/live_control.md).
    """

    mode: Mode = "async"
    group_size: int = 8
    buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    control: ControlConfig = field(default_factory=ControlConfig)

    @property
    def asynchronous(self) -> bool:
        """Whether rollouts go on while the trainer trains."""
        return self.mode == "async"

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, 1, "group_size")
        if self.buffer.batch_size % self.group_size:
            raise ValueError(
                f"buffer.batch_size {self.buffer.batch_size} must be a multiple of group_size "
                f"{self.group_size}: a batch holds whole groups"
            )
        self._deal_batches_to_trainer_ranks()

    def _deal_batches_to_trainer_ranks(self) -> None:
        """The buffer deals each batch out to the trainer's ranks (procs x hosts), an equal
        list each: buffer.dp_size is their number."""
        t, ranks = self.trainer_resources, self.trainer_ranks
        if ranks < 1:
            return  # the plan refuses such resources, naming their key
        if self.buffer.batch_size % ranks:
            raise ValueError(
                f"buffer.batch_size {self.buffer.batch_size} must be a multiple of "
                f"trainer_resources.procs {t.procs} x trainer_resources.hosts {t.hosts or 1} = "
                f"{ranks} trainer ranks: each trains an equal share"
            )
        self.buffer.dp_size = ranks

    def roles(self) -> list[Role]:
        return [
            *super().roles(),
            Role("buffer", ReplayBuffer, (self.buffer,)),
            # A service of one replica: a dead one is respawned, and `nth` retried on it.
            Role("dataset", DatasetActor, (self.data, self.eval.hold_out()), service=True),
        ]

    def generates(self) -> bool:
        return True  # its training data

    def workload(self) -> tuple[object, ...]:
        """What the phase costs of a step depend on besides the machine, its cores and the
        code: the models, the shape of a step, the trainer's settings (the calibration cache's
        key, forge.placement.calibration)."""
        t, s, w = self.trainer, self.generator.sampling, self.weight_sync
        return (
            self.generator.model, w.dtype, t.model, t.dtype, self.buffer.batch_size,
            self.group_size, s.max_tokens, self.data.path or self.data.task, t.micro_batch_size,
            t.logits_chunk_tokens, t.activation_checkpointing, t.objective, w.lora,
            self.env.factory, repr(self.env.options), self.env.limits.max_turns,
        )  # fmt: skip
