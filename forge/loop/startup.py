"""Starting a run: its parts, each constructed whole, in the order they depend on each other.

Everything started is registered on one exit stack as it starts (the provisioner's processes,
the weight transport's versions, the logs), so closing the stack closes exactly what was
started, in reverse order, however far the start got.
"""

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.config import check_available, config_error
from forge.controller import get_provisioner, init_provisioner, shutdown
from forge.data.chat import ChatBridge
from forge.data.datasets import PromptDataset, open_dataset
from forge.data.rewards import check_columns, resolve_reward
from forge.loop.config import RunConfig
from forge.loop.evaluation import EvalRows, Evaluator, eval_rows
from forge.loop.generator_handle import GeneratorHandle
from forge.loop.generator_sync import GeneratorSync
from forge.loop.live_settings import ControlRecord
from forge.loop.plan import plan_run
from forge.loop.rollouts import Rollouts
from forge.loop.run_folder import RunFolder
from forge.loop.run_logs import RunLogs
from forge.loop.spawn import spawn_roles
from forge.loop.trainer_handle import TrainerHandle
from forge.loop.trainer_lifecycle import TrainerLifecycle
from forge.models import load_tokenizer
from forge.observability.console import say
from forge.observability.startup import ENV as STARTUP_LOG
from forge.observability.startup import phase, process_started, record
from forge.placement.placer import Placer
from forge.placement.plan import GROUP, Plan
from forge.weights.shm_folders import claim_for_run, remove_dead
from forge.weights.transport import WeightTransport, make_transport

# An app's data: the training rows and the eval rows, checked against what reads them.
OpenData = Callable[[RunConfig], tuple[PromptDataset, EvalRows | None]]


@dataclass
class RunParts:
    """What a started run is made of; `Run` holds each part (see its attributes)."""

    folder: RunFolder
    placer: Placer
    data: PromptDataset
    actors: dict[str, Any]
    trainer: TrainerLifecycle
    logs: RunLogs
    generator: GeneratorHandle | None
    rollouts: Rollouts | None
    evaluator: Evaluator | None
    sync: GeneratorSync | None
    resumed: int  # the step of the checkpoint the run continues from (0: a new run)
    started: float  # perf_counter() at the start
    exits: AsyncExitStack  # closes what was started


async def start_parts(
    cfg: RunConfig, open_data: OpenData, name: str, plot_keys: Sequence[str], exits: AsyncExitStack
) -> RunParts:
    """Checks the config, data and placement, then starts every role and builds the parts on
    them; each started thing's close goes on `exits`.

    Raises:
        ConfigError: a model or environment factory not found here, an impossible placement,
            data that cannot be read, a reward the data cannot feed; before the folder or any
            process.
        RunFinished: the folder's run took `steps` already; before anything starts.
    """
    check_available(cfg)  # `forge run` checked it; a notebook's Run.start(cfg) had not
    plan = plan_run(cfg)
    opening = time.time()
    data, held_out = open_data(cfg)
    run_dir = Path(cfg.run_dir)
    folder = RunFolder(cfg.run_dir, cfg.trainer.checkpoint.folder)
    continuing = folder.holds_run()
    resumed = folder.open(cfg, cfg.resume)
    folder.rewind(resumed)
    live = ControlRecord(run_dir).apply(cfg)  # the settings changed live: in force again
    started = time.perf_counter()
    _open_startup_log(run_dir, opening)
    record("controller", "data", opening, time.time())
    said = _resuming(resumed) if continuing else ""
    said += f" | {live} live changes in force (control.jsonl)" if live else ""
    say(_summary(name, cfg, data, held_out) + said)
    with phase("controller", "provisioner"):
        transport = await _start_provisioner(cfg, plan, exits)
    # The episodes' chat bridge needs the generators' tokenizer: loaded while they start.
    tokenizer = None
    if cfg.generates():
        tokenizer = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, cfg.generator.model))
    placer = Placer(plan, say, run_dir / "pipeline.json")
    with phase("controller", "spawn roles"):
        actors = await spawn_roles(plan.roles)
    # Which hosts each role's processes landed on, for the user (and tests) to check.
    placement = [{"mesh": m, "hosts": h} for m, h in get_provisioner().placements()]
    (run_dir / "placement.json").write_text(json.dumps(placement, indent=1) + "\n")
    logs = _open_logs(cfg, list(actors.values()), plot_keys, exits)
    handle = TrainerHandle(actors["trainer"], placer.turns)  # the handles take the turns
    trainer = TrainerLifecycle(handle, cfg, placer, folder, logs, resumed)
    await trainer.watch()
    if (step := await handle.get_step()) != resumed:
        raise RuntimeError(f"trainer resumed step {step}, the run folder {resumed}")
    if live:  # over the settings its checkpoint restored
        await handle.set_optimisation(cfg.trainer)
    generator = rollouts = evaluator = sync = None
    if tokenizer is not None:
        generator = GeneratorHandle(actors["generator"], placer.turns)
        with phase("controller", "tokenizer wait"):
            bridge = ChatBridge(await tokenizer)
        rollouts = _rollouts(cfg, generator, bridge, actors)
        evaluator = None if held_out is None else _evaluator(cfg, held_out, rollouts, logs)
        sync = GeneratorSync(generator, trainer, transport, placer, logs, evaluator)
        generator.service.on_recover = sync.recover
    return RunParts(
        folder, placer, data, actors, trainer, logs, generator, rollouts, evaluator, sync,
        resumed, started, exits,
    )  # fmt: skip


def _open_startup_log(run_dir: Path, opening: float) -> None:
    """Starts run_dir/startup.jsonl afresh (a resumed run starts again) and names it to every
    process started from here on; records the controller's boot up to `opening`."""
    path = run_dir / "startup.jsonl"
    path.unlink(missing_ok=True)
    os.environ[STARTUP_LOG] = str(path)
    record("controller", "process boot", process_started(), opening)


def open_data(cfg: RunConfig) -> tuple[PromptDataset, EvalRows | None]:
    """The training rows and the eval rows, checked against the reward functions' columns.

    Raises:
        ConfigError: a source cannot be read, a row is malformed, a reward function cannot
            be imported or reads a column the data lacks; one line naming it.
    """
    with config_error("data"):
        data = open_dataset(cfg.data, cfg.eval.hold_out())
    with config_error("eval"):
        held_out = eval_rows(cfg.eval, cfg.data, data) if cfg.eval.interval else None
    with config_error("reward.functions"):
        functions = {name: resolve_reward(name) for name in cfg.reward.functions}
        check_columns(functions, data.name, data.columns)
        if held_out is not None:
            check_columns(functions, held_out.source, held_out.columns)
    return data, held_out


async def _start_provisioner(cfg: RunConfig, plan: Plan, exits: AsyncExitStack) -> WeightTransport:
    """The provisioner (its group reserved as the plan placed it) and the weight transport,
    emptied of versions an earlier run left behind."""
    init_provisioner(cfg.provisioner)
    # Last: what a process stopped by shutdown left in /dev/shm (one ended mid-cleanup).
    exits.callback(remove_dead)
    exits.push_async_callback(shutdown)  # every process, and the run's /dev/shm folder
    if plan.group is not None:
        g = plan.group
        await get_provisioner().reserve_group(
            GROUP, hosts=len(g.hosts), gpus=len(g.gpus[0]), cpus=len(g.cpus[0])
        )
    # Its /dev/shm folder, given back at shutdown(), holds an shm transport left unset.
    claim_for_run(cfg.run_dir, cfg.weight_sync.transport)
    if cfg.weight_sync.transport.kind in ("rdma", "torchstore"):  # rdma: handles, manifests
        # Imported only here: torchstore prints a warning on import, before any log exists.
        from forge.weights import torchstore_compat

        await torchstore_compat.initialize()
    transport = make_transport(cfg.weight_sync.transport)
    await transport.clear()
    exits.push_async_callback(transport.clear)  # shared memory is the machine's, not the run's
    return transport


def _open_logs(
    cfg: RunConfig, sources: list[Any], plot_keys: Sequence[str], exits: AsyncExitStack
) -> RunLogs:
    metrics = cfg.metrics
    if metrics.progress_total is None:
        metrics = dataclasses.replace(metrics, progress_total=cfg.steps)
    logs = RunLogs(Path(cfg.run_dir), metrics, sources)
    exits.callback(logs.show, plot_keys)
    exits.callback(logs.close)  # before the drawings: the files they read are complete
    return logs


def _rollouts(
    cfg: RunConfig, generator: GeneratorHandle, bridge: ChatBridge, actors: dict[str, Any]
) -> Rollouts:
    return Rollouts(
        cfg.env,
        generator,
        bridge,
        cfg.generator.sampling.max_tokens,
        cfg.generator.max_model_len,
        actors.get("environment"),
        actors.get("reward"),
    )


def _evaluator(cfg: RunConfig, held_out: EvalRows, rollouts: Rollouts, logs: RunLogs) -> Evaluator:
    held_out.write(Path(cfg.run_dir) / "eval_rows.jsonl")
    return Evaluator(held_out.rows, rollouts, cfg.eval, cfg.steps, logs)


def _resuming(step: int) -> str:
    """How a run its folder already holds goes on: from its newest checkpoint, or (where it
    stopped before writing one) from the start, its logged steps taken again."""
    return f" | resuming at step {step}" + ("" if step else " (no checkpoint yet: from the start)")


def _summary(name: str, cfg: RunConfig, data: PromptDataset, held_out: EvalRows | None) -> str:
    """The start-up line, said before anything starts: what trains on which rows, where the
    run is written."""
    skipped = len(data.skipped)
    rows = f"data {data.name}, {len(data)} rows" + (
        f" ({skipped} malformed skipped)" if skipped else ""
    )
    eval_rows = f" | eval {held_out.description}" if held_out else ""
    what = f"{name}: {cfg.trainer.model}, {cfg.steps} steps"
    return f"{what} | {rows}{eval_rows} | run folder {cfg.run_dir}"
