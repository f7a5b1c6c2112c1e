"""Running an app end to end through `python -m forge run`, and reading its run folder; and
`wait_until`, which any test uses to wait on a condition rather than on a fixed sleep."""

import asyncio
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).parents[1]
# The key that marks an eval's row in metrics.jsonl (docs/run_folder.md).
EVAL_ROW = "eval/version"

# The 64 one-digit additions the SmolLM2 learning tests' figures were measured on: the task's
# rows generated from another seed, which a procedural task holds out as well as held-out rows.
# Evaluated there, no row is held out of training either: the runs train on what they did.
MEASURED_EVAL_ROWS = (
    "eval.data={task: basic_arithmetic, config: {min_terms: 2, max_terms: 2, min_digits: 1, "
    "max_digits: 1, operators: ['+'], allow_parentheses: false, allow_negation: false}, "
    "seed: 1000003}"
)


async def wait_until(
    condition: Callable[[], object | Awaitable[object]],
    what: str = "",
    timeout: float = 60.0,
    poll: float = 0.01,
) -> None:
    """Polls `condition()` (awaited when it returns an awaitable) until it is true; fails
    naming `what` if it is not within `timeout` seconds.

    Tests wait on the event they need this way, never on a fixed sleep: a slow machine only
    makes the wait longer, and the test cannot go on before the event has happened.
    """
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            while True:
                holds = condition()
                if inspect.isawaitable(holds):
                    holds = await holds
                if holds:
                    return
                await asyncio.sleep(poll)
    except TimeoutError:
        if scope.expired():
            raise AssertionError(f"not within {timeout}s: {what or condition}") from None
        raise


def forge_run(app: str, config: str, run_dir: Path, *overrides: str) -> subprocess.Popen:
    """Starts `forge run apps/<app>/main.py --config <config> run_dir=<run_dir> overrides` (an
    `app` that ends in .py is the app file itself); its output goes to <run_dir>.log beside the
    run folder."""
    path = app if app.endswith(".py") else f"apps/{app}/main.py"
    cmd = [sys.executable, "-m", "forge", "run", path, "--config", config]
    cmd += [f"run_dir={run_dir}", *overrides]
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    # Its own process group, so a test can kill the driver with everything it started.
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def forge_replay(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """Runs `forge replay <run_dir> args` to its end; prints what it printed."""
    cmd = [sys.executable, "-m", "forge", "replay", str(run_dir), *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(done.stdout, done.stderr)
    return done


def forge_status(run_dir: Path) -> str:
    """What `forge status <run_dir>` prints; fails unless it exits 0."""
    cmd = [sys.executable, "-m", "forge", "status", str(run_dir)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    print(done.stdout)
    return done.stdout


def console(run_dir: Path) -> str:
    """What the last `forge_run` of `run_dir` printed."""
    return (run_dir.parent / f"{run_dir.name}.log").read_text()


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 900) -> None:
    """Waits for the run and fails with the end of its console output and of its library log
    (run_dir/forge.log) unless it exited 0."""
    code = proc.wait(timeout=timeout)
    console = (run_dir.parent / f"{run_dir.name}.log").read_text()
    library = run_dir / "forge.log"
    log = library.read_text()[-3000:] if library.exists() else ""
    assert code == 0, f"{log}\n--- console ---\n{console[-1500:]}"


def finish_all(procs: dict[str, subprocess.Popen], run_dirs: dict[str, Path]) -> None:
    """`finish` for runs started side by side (same keys); kills those left if one fails."""
    try:
        for key, run_dir in run_dirs.items():
            finish(procs[key], run_dir)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's steps' rows (not the evals')."""
    return [m for m in jsonl(run_dir / "metrics.jsonl") if EVAL_ROW not in m]


def eval_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's evals' rows, in the order of the steps they scored."""
    rows = [m for m in jsonl(run_dir / "metrics.jsonl") if EVAL_ROW in m]
    return sorted(rows, key=lambda m: m["step"])


def trained(run_dir: Path) -> list[dict]:
    return jsonl(run_dir / "trained_episodes.jsonl")


def evals(run_dir: Path, key: str) -> list[dict]:
    """The eval.jsonl records that hold `key` ("reward" or "loss"), in step order."""
    return sorted((r for r in jsonl(run_dir / "eval.jsonl") if key in r), key=lambda r: r["step"])


def processes_of(driver: int, marker: str) -> list[int]:
    """Pids of the driver's descendant processes whose name or command line has `marker`."""
    return [p.pid for p in descendants(driver) if marker in p.name() + " ".join(p.cmdline())]


def processes_with_env(driver: int, key: str, value: str) -> list[int]:
    """Pids of the driver's descendant processes started with `key=value` in their
    environment (a role's `env` in the config marks its processes), less those a marked process
    started itself (they inherit the mark)."""
    marked = {}
    for p in descendants(driver):
        try:
            if p.environ().get(key) == value:
                marked[p.pid] = p.ppid()
        except psutil.NoSuchProcess:  # ended since it was listed
            pass
    return [pid for pid, parent in marked.items() if parent not in marked]


def shm_mapped(driver: int) -> tuple[set[Path], list[psutil.Process]]:
    """The /dev/shm paths the driver and its descendants map, and those processes: what is a
    run's own in shared memory, taken from the running processes themselves."""
    from forge.weights.shm_folders import SHM_ROOT

    processes = [psutil.Process(driver), *psutil.Process(driver).children(recursive=True)]
    paths = set()
    for p in processes:
        try:
            paths |= {Path(m.path) for m in p.memory_maps() if m.path.startswith(f"{SHM_ROOT}/")}
        except psutil.NoSuchProcess:
            pass
    return paths, processes


def descendants(driver: int) -> list[psutil.Process]:
    """The driver's descendant processes alive now (none once the driver is gone)."""
    try:
        children = psutil.Process(driver).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    alive = []
    for p in children:
        try:
            p.name(), p.cmdline(), p.environ()
            alive.append(p)
        except psutil.NoSuchProcess:
            pass  # ended meanwhile
    return alive


def kill_one_mid_run(
    proc: subprocess.Popen, run_dir: Path, find: Callable[[int], list[int]], expected: int
) -> None:
    """After 3 steps, SIGKILLs the first of the `expected` processes `find(driver pid)`
    returns, then waits for the run to finish; the driver is killed if the test fails."""
    try:
        kill_one_after_3_steps(proc, run_dir, find, expected)
        finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()


def kill_one_after_3_steps(
    proc: subprocess.Popen, run_dir: Path, find: Callable[[int], list[int]], expected: int
) -> None:
    """After 3 steps, SIGKILLs the first of the `expected` processes `find(driver pid)`
    returns."""
    wait_for_steps(proc, run_dir, 3)
    victims = find(proc.pid)
    assert len(victims) == expected, victims
    os.kill(victims[0], signal.SIGKILL)


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, timeout: float = 300):
    """Polls metrics.jsonl until it holds `steps` steps; fails if the run ends first."""
    deadline = time.monotonic() + timeout
    while not (run_dir / "metrics.jsonl").exists() or len(metrics(run_dir)) < steps:
        assert proc.poll() is None and time.monotonic() < deadline, "run ended early"
        time.sleep(0.5)


def wait_for_metric(proc: subprocess.Popen, run_dir: Path, key: str, timeout: float = 600) -> int:
    """Polls metrics.jsonl until a step reports `key` >= 1; returns that step."""
    deadline = time.monotonic() + timeout
    while True:
        hit = [m["step"] for m in metrics(run_dir) if m.get(key, 0) >= 1]
        if hit:
            return hit[0]
        assert proc.poll() is None and time.monotonic() < deadline, f"no {key} in {timeout}s"
        time.sleep(0.5)


def complete_groups(run_dir: Path, group_size: int, steps: list[dict]) -> None:
    """Every episode trained once; missing group members only as counted stale evictions.

    A group's samples can carry different versions (a drain lets queued samples start on the
    new weights), so one can go stale alone: it is evicted and counted, never silently lost.
    Only the last batch may hold part of a group whose rest was still buffered.
    """
    records = trained(run_dir)
    ids = [e for s in records for e in s["episodes"]]
    assert len(ids) == len(set(ids))  # nothing trained twice
    groups: dict[str, int] = {}
    for episode in ids:
        group = episode.split("-")[0]
        groups[group] = groups.get(group, 0) + 1
    last_batch = {e.split("-")[0] for e in records[-1]["episodes"]}
    missing = sum(group_size - n for g, n in groups.items() if g not in last_batch)
    assert max(groups.values()) == group_size
    assert missing <= max(m.get("buffer/evicted_stale", 0) for m in steps)
    for record in records:  # bounded staleness, by construction
        ages = [record["trainer_version"] - v for v in record["policy_versions"]]
        assert 0 <= min(ages) and max(ages) <= 1, record


def kill_groups_after_a_checkpoint(procs: dict[Path, subprocess.Popen]) -> None:
    """SIGKILLs each driver's whole process group as soon as its run has written a checkpoint
    and logged a later step; waits until every process of those runs is gone."""
    from forge.actors.trainer.checkpoint_folder import (
        latest_step,  # the trainer package imports torch: only the tests that run apps
    )

    deadline = time.monotonic() + 600
    waiting = dict(procs)
    while waiting:
        for run_dir, proc in list(waiting.items()):
            if latest_step(run_dir / "checkpoints") >= 2 and _steps_logged(run_dir) >= 3:
                _kill_group(proc)
                del waiting[run_dir]
            else:
                assert proc.poll() is None, console(run_dir)[-2000:]
        assert time.monotonic() < deadline, "no checkpoint within 600s"
        time.sleep(0.1)


def _kill_group(proc: subprocess.Popen) -> None:
    family = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in family if psutil.pid_exists(p)], 30)
    assert not alive, [p.cmdline() for p in alive]


def _steps_logged(run_dir: Path) -> int:
    log = run_dir / "metrics.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(EVAL_ROW not in line for line in lines)
