"""The `forge` command line (also `python -m forge`).

    forge run APP_PATH --config FILE [--verbose] [key=value ...]
    forge submit APP_PATH --config FILE [--partition P] [--nodes N] [--time T] [--account A]
                 [--qos Q] [--dry-run] [key=value ...]
    forge clean
    forge replay RUN_DIR (--step N | --all) [--verbose] [key=value ...]
    forge plan APP_PATH --config FILE [--hosts N] [--gpus-per-host G] [--cpus-per-host C]
               [--recalibrate] [key=value ...]
    forge config show APP_PATH --config FILE [--key KEY] [key=value ...]
    forge --version

`forge run` runs an app: a python file such as apps/grpo/main.py that defines `main(cfg)`, plain or
`async def`, whose first parameter is annotated with the app's config dataclass. The config is
loaded from FILE (required: configs/ holds one per app and machine) and the overrides
(`trainer.optimizer.lr=1e-4`, see forge.config) before main is called, so a bad config fails
with one line before any process starts. When the config has a `run_dir`, everything but
forge's own lines (vLLM, Monarch, torch: this process's and its children's output) goes to
<run_dir>/forge.log unless `--verbose`; a failure is one line on the console, an actor's told by
the exception raised in it.

`forge submit` runs the same `forge run` command as one SLURM batch job, the driver inside the
allocation (forge/controller/slurm/submit.py); it prints the job id, the run folder and the log.
Submitting the same command again resumes the run; `scancel JOB` stops all of it.

`forge clean` gives back the shared memory (/dev/shm) of forge processes that died without
doing so themselves (killed with SIGKILL); runs do the same when they start.

`forge replay` trains a run's recorded batches again (forge/loop/record/replay.py): step N, or every
step, compared figure by figure with the record; overrides of trainer.loss, trainer.optimizer,
trainer.scheduler, trainer.max_grad_norm or trainer.guard make a what-if. Exit status 0 when
the replay matches the record, 1 when a figure differs, 2 on bad input, 3 when the replay
itself failed (a trainer died).

`forge plan` prints where every proc mesh of the run would go (hosts, GPUs, cores; see
forge/loop/plan.py), on the config's cluster or the shape given, and refuses an impossible
config with one line, as `forge run` does before starting anything. `--recalibrate` drops the
phase costs cached on this machine for the config's workload: its next `placement: auto` run
measures them again.

`forge config show` loads the config as `forge run` does and prints each setting on a line: its
dotted key, value, default and meaning (forge/config_fields.py); `--key trainer.optimizer`
prints that section alone.
"""

import argparse
import asyncio
import dataclasses
import importlib.metadata
import importlib.util
import inspect
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn, TypeVar, get_type_hints

import cloudpickle

from forge.config import ConfigError, load_config
from forge.observability.console import capture_to, say

E = TypeVar("E", bound=BaseException)

# The name an app file is imported under: apps/ is not a package, so it has no dotted name.
APP_MODULE = "forge_app"
# The installed distribution whose version `forge --version` prints: pyproject.toml's name.
DISTRIBUTION = "forge"
# The config a refusal for a missing --config names: the smallest that runs.
EXAMPLE_CONFIG = "configs/grpo/tiny_cpu.yaml"


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `forge` console script; `argv` defaults to sys.argv[1:]."""
    # Arguments that are not options of the subcommand are its config overrides.
    args, overrides = _parser().parse_known_args(argv)
    try:
        args.command(args, overrides)
    except ConfigError as e:
        _fail(f"config error: {e}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forge", description="forge: async RL post-training")
    parser.add_argument("--version", action="version", version=f"forge {_version()}")
    commands = parser.add_subparsers(title="commands", required=True)
    run = commands.add_parser(
        "run",
        usage="forge run APP_PATH --config FILE [--verbose] [key=value ...]",
        help="run an app with its config",
        description="Load the config, then call main(cfg) of the app file.",
        epilog="key=value overrides take dotted keys (trainer.optimizer.lr=1e-4), parsed as "
        "yaml; `forge config show` lists every key.",
    )
    _add_app_arguments(run)
    run.add_argument(
        "--verbose",
        action="store_true",
        help="show every library's output here too, instead of only in <run_dir>/forge.log",
    )
    run.set_defaults(command=_run)
    _add_submit(commands)
    clean = commands.add_parser(
        "clean",
        help="remove the shared memory that dead forge processes left",
        description="Remove every forge folder in /dev/shm whose owner process is dead.",
    )
    clean.set_defaults(command=_clean)
    _add_replay(commands)
    _add_status(commands)
    _add_serve(commands)
    _add_plan(commands)
    _add_config(commands)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "(not installed)"


def _add_submit(commands: Any) -> None:
    submit = commands.add_parser(
        "submit",
        usage="forge submit APP_PATH --config FILE [--partition P] [--nodes N] [--time T] "
        "[--account A] [--qos Q] [--dry-run] [key=value ...]",
        help="run an app as one SLURM batch job",
        description="Submit `forge run APP_PATH ...` as one SLURM batch job whose driver runs "
        "inside the allocation. Options default to the config's provisioner.slurm.",
        epilog="The same command again resumes the run; scancel JOB stops every process of it.",
    )
    _add_app_arguments(submit)
    for option in ("partition", "time", "account", "qos"):
        submit.add_argument(f"--{option}", help=f"sbatch --{option} (provisioner.slurm.{option})")
    submit.add_argument(
        "--nodes", type=int, help="nodes to allocate (slurm launcher: sets provisioner.hosts)"
    )
    submit.add_argument(
        "--dry-run", action="store_true", help="print the batch script and the plan; submit nothing"
    )
    submit.set_defaults(command=_submit)


def _add_replay(commands: Any) -> None:
    replay = commands.add_parser(
        "replay",
        usage="forge replay RUN_DIR (--step N | --all) [--verbose] [key=value ...]",
        help="train a run's recorded batches again and compare with the record",
        description="Load the newest checkpoint before step N, train the recorded batches up to "
        "it, take step N and print its figures beside the recorded ones (--all: every step "
        "from the start, then the final checkpoint's parameters).",
        epilog="key=value overrides of trainer.loss, trainer.optimizer, trainer.scheduler, "
        "trainer.max_grad_norm or trainer.guard re-run the step under other settings. Exit "
        "status: 0 the replay matches the record, 1 a figure differs, 2 bad input, 3 the replay "
        "failed.",
    )
    replay.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's folder")
    which = replay.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=int, help="the step to replay")
    which.add_argument("--all", action="store_true", help="every step, from the start")
    replay.add_argument(
        "--verbose", action="store_true", help="show library output here, not in RUN_DIR/replay.log"
    )
    replay.set_defaults(command=_replay)


def _replay(args: argparse.Namespace, overrides: list[str]) -> None:
    """`forge replay`: checks, then the replay; exits with its status."""
    from forge.loop.record.replay import Replay, ReplayError  # Monarch and torch: not for --help

    try:
        replay = Replay.prepare(args.run_dir, None if args.all else args.step, overrides)
    except ReplayError as e:
        _fail(f"replay: {e}")
    log = args.run_dir / "replay.log"
    if not args.verbose:
        say(f"library output: {log}")
        capture_to(log)
    try:
        status = asyncio.run(replay.run())
    except ReplayError as e:  # a record found unreadable on the way
        say(f"forge: replay: {e}")  # on the console: stderr now goes to the log
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        say("forge: replay interrupted")
        raise
    except Exception as e:  # not a verdict on the record: the traceback goes to the log
        say(f"forge: replay failed: {_gist(e)} ({log})")
        raise SystemExit(3) from e
    raise SystemExit(status)


def _add_status(commands: Any) -> None:
    status = commands.add_parser(
        "status",
        usage="forge status RUN_DIR [--watch SECONDS]",
        help="show a run's step, pace, rewards and checkpoint, from its folder",
        description="Read the run's folder: whether its driver runs (on this host), its step of "
        "the config's steps, seconds a step and the time to go, the newest rollout and eval "
        "rewards, each role's phases' share of the time, the newest checkpoint.",
    )
    status.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's folder")
    status.add_argument(
        "--watch",
        type=_positive_seconds,
        metavar="SECONDS",
        help="show it again every SECONDS while the run runs (here or on another host)",
    )
    status.set_defaults(command=_status)


def _status(args: argparse.Namespace, overrides: list[str]) -> None:
    """`forge status`: the run folder's view of its run, once or while it runs."""
    from forge.loop.status import read_status

    if overrides:
        _fail(f"status: unexpected arguments {' '.join(overrides)}")
    try:
        status = read_status(args.run_dir)
        while args.watch and status.state in ("running", "elsewhere"):
            print(_status_lines(status) + "\n", flush=True)
            time.sleep(args.watch)
            status = read_status(args.run_dir)
    except FileNotFoundError as e:
        _fail(f"status: {e}")
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    print(_status_lines(status))


def _status_lines(status: Any) -> str:
    """The folder's status and, from a running driver that answers its owner here, its live
    part (a driver on another host answers only where it listens beyond its loopback)."""
    from forge.loop.status import render
    from forge.serve.attach import ControlError, attach, live_lines

    lines = render(status)
    if status.state not in ("running", "elsewhere"):
        return lines
    try:
        run = attach(status.run_dir, timeout_s=10)
        if status.state == "elsewhere" and run.loopback:
            return lines
        return "\n".join([lines, *live_lines(run.status())])
    except ControlError as e:
        return f"{lines}\nlive: {e}"


def _positive_seconds(text: str) -> float:
    seconds = float(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text}: seconds must be more than 0")
    return seconds


def _submit(args: argparse.Namespace, overrides: list[str]) -> None:
    """`forge submit`: check the config and its placement here, then sbatch the run."""
    # Imported here: they load Monarch and torch (seconds), which `forge --help` need not.
    from forge.controller.slurm.submit import SubmitError, batch_script, submit
    from forge.loop.plan import plan_run

    schema, cfg = _load_run_config(args, overrides, "submit")
    if args.nodes is not None and args.nodes != cfg.provisioner.nodes:
        if not cfg.provisioner.host_launcher().spans_nodes:
            raise ConfigError(
                f"--nodes {args.nodes}: provisioner.launcher={cfg.provisioner.launcher} runs on "
                "one node; set provisioner.launcher=slurm to spread a run over several"
            )
        overrides = [*overrides, f"provisioner.hosts={args.nodes}"]  # the job's command too
        cfg = load_config(schema, args.config, overrides)
    plan = plan_run(cfg)  # an impossible placement fails here, not in the queue
    flags = {k: getattr(args, k) for k in ("partition", "time", "account", "qos")}
    slurm = dataclasses.replace(
        cfg.provisioner.slurm, **{k: v for k, v in flags.items() if v is not None}
    )
    run_dir = Path(cfg.run_dir).resolve()
    log = run_dir / "slurm-%j.out"
    command = [slurm.python_exe or sys.executable, "-m", "forge", "run", str(args.app)]
    command += ["--config", str(args.config), *overrides]
    try:
        script = batch_script(
            command, slurm, nodes=cfg.provisioner.nodes, log=log, workdir=Path.cwd()
        )
        if args.dry_run:
            print(f"{script}\n{plan.table()}")
            return
        run_dir.mkdir(parents=True, exist_ok=True)  # SLURM opens the log before the job runs
        job = submit(script)
    except SubmitError as e:
        _fail(f"submit: {e}")
    print(f"job: {job}\nrun folder: {run_dir}\nlog: {str(log).replace('%j', job)}")


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        usage="forge serve --config FILE [key=value ...]",
        help="serve the Tinker API: the tinker SDK's loops train and sample with forge",
        description="Start an HTTP server that speaks the Tinker REST API (docs/tinker.md) on "
        "forge's trainer and generators, until Ctrl-C or SIGTERM.",
    )
    serve.add_argument(
        "--config", metavar="FILE", type=Path, help="yaml config, e.g. configs/serve/tiny_cpu.yaml"
    )
    serve.set_defaults(command=_serve)


def _serve(args: argparse.Namespace, overrides: list[str]) -> None:
    """`forge serve`: the Tinker API until stopped; library output in its folder's forge.log."""
    from forge.loop.stop_signals import ShutdownConfig, Stopped, run_stoppable
    from forge.serve.tinker.config import ServeConfig
    from forge.serve.tinker.lifecycle import serve

    if args.config is None:
        _fail("error: forge serve needs --config FILE, e.g. --config configs/serve/tiny_cpu.yaml")
    cfg = load_config(ServeConfig, args.config, overrides, available=True)
    log = Path(cfg.state_dir) / "forge.log"
    say(f"forge serve --config {args.config} | library output: {log}")
    capture_to(log)
    try:
        run_stoppable(serve(cfg), ShutdownConfig().grace_s)
    except (Stopped, KeyboardInterrupt):
        say("forge serve: stopped")
    except BaseException as e:
        say(f"forge serve: failed: {_gist(e)} (details: {log})")
        raise


def _add_app_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("app", metavar="APP_PATH", type=Path, help="python file defining main(cfg)")
    parser.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help=f"yaml config file (required), e.g. {EXAMPLE_CONFIG}",
    )


def _load_app_config(
    args: argparse.Namespace, overrides: list[str], command: str, available: bool = False
) -> tuple[Callable[[Any], Any], type, Any]:
    """The app's main, its config class and its config loaded from --config and `overrides`:
    the one way every command taking an APP_PATH loads it. `available`: also check that the
    models and the environment factory it names are here (a run about to start)."""
    # Required, not defaulted: a forgotten --config would start a run of the defaults.
    if args.config is None:
        _fail(f"error: forge {command} needs --config FILE, e.g. --config {EXAMPLE_CONFIG}")
    app_main, schema = load_app(args.app)
    return app_main, schema, load_config(schema, args.config, overrides, available=available)


def _load_run_config(
    args: argparse.Namespace, overrides: list[str], command: str
) -> tuple[type, Any]:
    """The app's config class and its loaded config, for commands that need a RunConfig."""
    from forge.loop import RunConfig

    _, schema, cfg = _load_app_config(args, overrides, command)
    if not isinstance(cfg, RunConfig):
        _fail(f"error: {args.app}: forge {command} needs an app whose config is a RunConfig")
    return schema, cfg


def _add_plan(commands: Any) -> None:
    plan = commands.add_parser(
        "plan",
        usage="forge plan APP_PATH --config FILE [--hosts N] [--gpus-per-host G] "
        "[--cpus-per-host C] [--recalibrate] [key=value ...]",
        help="print where every proc mesh of a run would go, or why it cannot",
        description="Load the config and place every proc mesh of the run on the cluster "
        "(the config's provisioner, or the shape the options give) as the run will.",
        epilog="An impossible placement is one line naming the config keys, exit status 2.",
    )
    _add_app_arguments(plan)
    for flag, what in (("hosts", "hosts"), ("gpus-per-host", "GPUs"), ("cpus-per-host", "cores")):
        plan.add_argument(f"--{flag}", type=int, metavar="N", help=f"{what} (else the config's)")
    plan.add_argument(
        "--recalibrate",
        action="store_true",
        help="drop the phase costs cached here for this workload: the next auto run measures",
    )
    plan.set_defaults(command=_plan)


def _plan(args: argparse.Namespace, overrides: list[str]) -> None:
    """`forge plan`: the placement table of the app's config."""
    # Imported here: it loads Monarch and torch (seconds), which `forge --help` need not.
    from forge.loop.plan import plan_run

    _, cfg = _load_run_config(args, overrides, "plan")
    given = {k: getattr(args, k) for k in ("hosts", "gpus_per_host", "cpus_per_host")}
    shape = dataclasses.replace(
        cfg.provisioner.cluster_shape(), **{k: v for k, v in given.items() if v is not None}
    )
    plan = plan_run(cfg, shape)
    print(plan.table())
    cores = _pipeline_cores(plan) if hasattr(cfg, "buffer") else 0
    if args.recalibrate:
        print(_recalibrate(cfg, cores))
    if cores:
        print(_predictions(cfg, plan, cores))


def _pipeline_cores(plan: Any) -> int:
    """The cores generator and trainer hold between them on their one host, which the pipeline
    model shares or splits; 0 where they are not pinned to cores of one host."""
    placements = [*plan.of_role("generator"), *plan.of_role("trainer")]
    one_host = len({p.hosts for p in placements}) == 1 and len(placements[0].hosts) == 1
    if not one_host or not all(p.cpus[0] for p in placements):
        return 0
    return len({c for p in placements for c in p.cpus[0]})


def _predictions(cfg: Any, plan: Any, cores: int) -> str:
    """The pipeline model's table for an RL config's `plan` on `cores` CPU cores, from the
    calibration cached on this machine (a run under `placement: auto` measures it), the
    placement the run takes starred."""
    from forge.loop.config import overlaps
    from forge.placement import calibration
    from forge.placement.cost_model import decide, predict, table
    from forge.placement.placer import choose

    costs = calibration.load(calibration.cache_key(cfg.workload(), cores))
    if costs is None:
        return "pipeline model: not calibrated on this machine for this workload yet"
    age = cfg.buffer.max_policy_age
    options = predict(costs, cores, overlaps(cfg.mode, age), age, cfg.trainer.exact_mismatch)
    chosen, decision = choose(plan, options, costs.spread), decide(options, costs.spread)
    best = decision.chosen
    if plan.auto:
        moved = "" if best.colocated else f"; the run starts {plan.placement}, then moves"
        taken = f"placement auto takes {decision.line()}{moved}"
    elif chosen is None:
        taken = f"placement {plan.placement}: its cores are not among the options the costs cover"
    else:
        faster = "" if chosen == best else f"; {best.label} is predicted faster (placement auto)"
        taken = f"placement {chosen.label}{faster}"
    return f"pipeline model (calibration cached here): {taken}\n{table(options, chosen)}"


def _recalibrate(cfg: Any, cores: int) -> str:
    """Drops the phase costs cached for an RL config's workload on `cores` CPU cores (0: its
    placement is not calibrated), and says so in one line."""
    from forge.placement import calibration

    if not cores:
        return "recalibrate: nothing to drop: this config's placement is not calibrated"
    key = calibration.cache_key(cfg.workload(), cores)
    if calibration.load(key) is None:
        return "recalibrate: nothing cached here for this workload; the next auto run measures"
    calibration.forget(key)
    return "recalibrate: the cached phase costs are dropped; the next auto run measures them"


def _add_config(commands: Any) -> None:
    config = commands.add_parser(
        "config",
        help="show an app's config",
        description="Inspect an app's config as `forge run` loads it.",
    )
    show = config.add_subparsers(title="commands", required=True).add_parser(
        "show",
        usage="forge config show APP_PATH --config FILE [--key KEY] [key=value ...]",
        help="print every setting: its value, default and meaning",
        description="Load the config as `forge run` does and print each setting on a line: "
        "its dotted key, value and default (as JSON) and its meaning, from the docstring of "
        "the config dataclass that declares it.",
        epilog="e.g. forge config show apps/grpo/main.py --config configs/grpo/tiny_cpu.yaml "
        "trainer.optimizer.lr=1e-4 --key trainer.optimizer",
    )
    _add_app_arguments(show)
    show.add_argument("--key", help="only this setting, or the settings of this section")
    show.set_defaults(command=_config_show)


def _config_show(args: argparse.Namespace, overrides: list[str]) -> None:
    """`forge config show`: one line per setting of the loaded config (under --key)."""
    from forge.config_fields import settings

    _, _, cfg = _load_app_config(args, overrides, "config show")
    print("\n".join(s.line() for s in settings(cfg, args.key)))


def _clean(args: argparse.Namespace, overrides: list[str]) -> None:
    """`forge clean`: one line per folder removed, then the total."""
    if overrides:
        _fail(f"error: forge clean takes no arguments, got {' '.join(overrides)}")
    # Imported here: it loads Monarch (seconds), which `forge --help` or a usage error need not.
    from forge.weights.shm_folders import SHM_ROOT, remove_dead

    removed = remove_dead()
    for folder, owner, size in removed:
        print(f"removed {folder} ({size / 1e6:.1f} MB; {owner.what}, pid {owner.pid} is gone)")
    total = sum(size for _, _, size in removed)
    print(
        f"forge clean: {len(removed)} folders of dead processes removed from {SHM_ROOT}, "
        f"{total / 1e6:.1f} MB given back"
    )


def _run(args: argparse.Namespace, overrides: list[str]) -> None:
    """`forge run`: import the app, load its config, call its main."""
    from forge.controller.slurm.submit import HOST_LOST_STATUS, requeue
    from forge.loop.stop_signals import Stopped

    app_main, _, cfg = _load_app_config(args, overrides, "run", available=True)
    try:
        _run_app(args, app_main, cfg)
    except Stopped as e:  # ended cleanly after the signal: 128 + its number, as shells report
        if e.signum == signal.SIGUSR1:  # SLURM's time-limit warning (SlurmConfig.warning_s)
            requeue(cfg.provisioner.slurm.max_requeues)  # inside a forge submit job
        raise SystemExit(128 + e.signum) from None
    except Exception as e:
        if not _host_lost(e):
            raise
        requeue(cfg.provisioner.slurm.max_requeues)  # inside a forge submit job
        raise SystemExit(HOST_LOST_STATUS) from e


def _run_app(args: argparse.Namespace, app_main: Callable[[Any], Any], cfg: Any) -> None:
    """Calls the app's main; with a run folder, library output goes to its log and the
    console gets forge's lines and one line for a failure."""
    from forge.loop.stop_signals import Stopped

    run_dir = getattr(cfg, "run_dir", None)
    if run_dir is None or args.verbose:
        _call(app_main, cfg)
        return
    log = Path(run_dir) / "forge.log"
    made = not log.parent.exists()
    say(f"forge run {args.app} --config {args.config} | library output: {log}")
    capture_to(log)
    try:
        _call(app_main, cfg)
    except ConfigError as e:  # found by the run: its folder holds another config's run
        say(f"forge: config error: {e}")  # on the console: stderr now goes to the log
        if made and [p.name for p in log.parent.iterdir()] == [log.name]:
            shutil.rmtree(log.parent)  # the one line says it all: leave no folder behind
        raise SystemExit(2) from None
    except Stopped:
        raise  # its line is said
    except BaseException as e:  # the traceback goes to the log; the console gets its gist
        what = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        death = _process_death(e)
        gist = f"{death}; {_resumes(cfg)}" if death else _gist(e)
        say(f"forge: run {what}: {gist} (details: {log})")
        raise


def _gist(error: BaseException) -> str:
    """`error` in one line: its type and its message's first line. An error raised in an actor
    (Monarch's ActorError, whose message only says which call failed) is told by the exception
    the actor raised, after the call: `TitanTrainer.setup: ValueError: unknown model 'x'`."""
    from monarch.actor import ActorError  # loaded by any app with actors; not for --help

    call = ""
    while isinstance(error, ActorError):  # an actor's call of another actor nests them
        if not call:
            named = re.fullmatch(r"Actor call (\S+) failed.*", error.message)
            call = f"{named[1] if named else error.message}: "
        error = error.exception
    first = (str(error).splitlines() or [""])[0]
    return f"{call}{type(error).__name__}{': ' + first if first else ''}"


def _process_death(error: BaseException | None) -> str | None:
    """The death of an actor's process that failed a call, among the causes of `error`, in
    words ("ReplayBuffer's process was killed by SIGKILL (in ReplayBuffer.add)"); None if a
    call failed for another reason, or none did."""
    from forge.controller import SupervisionError

    text = str(_cause_of(error, SupervisionError) or "")
    call = re.search(r"Endpoint call (\w+)\.(\w+)\(\) failed", text)
    # torchmonarch 0.7's ProcStatus: Killed(sig=9), Killed(sig=9, core), Stopped(exit=1)
    how = re.search(r"the process this actor was running on failed: (\w+)\((\w+)=(-?\d+)", text)
    if call is None or how is None:
        return None
    actor, endpoint = call.groups()
    kind, _, number = how.groups()
    if kind == "Killed":
        ended = f"was killed by {signal.Signals(int(number)).name}"
    else:
        ended = f"exited with status {number}"
    return f"{actor}'s process {ended} (in {actor}.{endpoint})"


def _resumes(cfg: Any) -> str:
    """What the same command does next: resume from the newest checkpoint, or start again."""
    from forge.actors.trainer.checkpoint_folder import latest_step
    from forge.loop.config import RunConfig

    step = latest_step(cfg.trainer.checkpoint.folder) if isinstance(cfg, RunConfig) else 0
    if step:
        return f"the same command resumes the run from its checkpoint of step {step}"
    return "the same command starts the run again (no checkpoint yet)"


def _host_lost(error: BaseException | None) -> bool:
    """Whether a lost host (HostLostError) is among the causes of `error`."""
    from forge.controller import HostLostError

    return _cause_of(error, HostLostError) is not None


def _cause_of(error: BaseException | None, kind: type[E]) -> E | None:
    """The first of `error` and its causes (raised from, or while handling) that is a `kind`."""
    while error is not None and not isinstance(error, kind):
        error = error.__cause__ or error.__context__
    return error


def _call(app_main: Callable[[Any], Any], cfg: Any) -> None:
    """Calls the app's main, which a signal stops as Ctrl-C does (forge.loop.stop_signals:
    Stopped)."""
    from forge.loop.config import RunConfig
    from forge.loop.stop_signals import ShutdownConfig, run_stoppable

    result = app_main(cfg)
    if inspect.iscoroutine(result):
        run = cfg if isinstance(cfg, RunConfig) else None
        grace_s = (run.shutdown if run else ShutdownConfig()).grace_s
        run_stoppable(result, grace_s, run.trainer.checkpoint.folder if run else None)


def load_app(path: Path) -> tuple[Callable[[Any], Any], type]:
    """The `main` of the app file at `path`, and the config dataclass its first parameter takes."""
    if path.suffix != ".py" or not path.is_file():
        _fail(f"error: {path}: not a python file")
    app_main = getattr(import_app(path), "main", None)
    if not callable(app_main):
        _fail(f"error: {path}: defines no main(cfg)")
    params = list(inspect.signature(app_main).parameters)
    schema = get_type_hints(app_main).get(params[0]) if params else None
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        _fail(f"error: {path}: the first parameter of main must be annotated with a dataclass")
    return app_main, schema


def import_app(path: str | Path) -> ModuleType:
    """Imports the app file at `path` (as module APP_MODULE), e.g. to build its objects in a
    notebook: `grpo = import_app("apps/grpo/main.py"); run = await grpo.GRPO.start(cfg)`."""
    spec = importlib.util.spec_from_file_location(APP_MODULE, path)
    assert spec is not None and spec.loader is not None  # a .py file always has both
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would: dataclasses look their module up there.
    sys.modules[APP_MODULE] = module
    spec.loader.exec_module(module)
    # Actor processes cannot import the app by name, so what it defines (a reward function, an
    # actor class) is sent to them by value.
    cloudpickle.register_pickle_by_value(module)
    return module


def _fail(message: str) -> NoReturn:
    """Print one line to stderr and exit with status 2, as argparse does for bad usage."""
    print(f"forge: {message}", file=sys.stderr)
    raise SystemExit(2)
