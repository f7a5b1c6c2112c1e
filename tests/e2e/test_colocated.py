"""Colocated and auto placement end to end, on tiny models and real processes.

Colocated: generator and trainer both hold every core, and while one phase runs the other
process does not spin. Auto: the calibration is measured and cached, the choice is the
split only where it wins by more than the spread, and the processes are moved onto its
cores; a process that is not the run's, busy on a core while it calibrates, is seen. (Sync ==
async at age 0 in colocated mode is tests/e2e/test_grpo.py's, parametrised by placement.)
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from forge.cli import import_app
from forge.config import load_config
from forge.loop.config import overlaps
from forge.placement import calibration, load
from forge.placement.cost_model import PhaseCosts, decide, predict

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
ALL = sorted(os.sched_getaffinity(0))
PHASE_S = 3.0  # how long each phase is kept busy while the other is watched


async def start(tmp_path: Path, *overrides: str):
    grpo = import_app(ROOT / "apps/grpo/main.py")
    cfg = load_config(
        grpo.Config,
        ROOT / "configs/grpo/tiny_cpu.yaml",
        [f"run_dir={tmp_path / 'run'}", "eval.interval=0", "export_hf=false", *overrides],
    )
    return await grpo.GRPO.start(cfg)


def cpu_seconds(pids: list[int]) -> float:
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


async def core_use_while(pids: list[int], work) -> float:
    """Cores the processes `pids` used on average while `work` ran, over and over, for
    PHASE_S seconds."""
    before, start = cpu_seconds(pids), time.perf_counter()
    while time.perf_counter() - start < PHASE_S:
        await work()
    return (cpu_seconds(pids) - before) / (time.perf_counter() - start)


async def test_colocated_phases_see_every_core_and_the_idle_one_does_not_spin(tmp_path):
    run = await start(tmp_path, "placement=colocated", "mode=sync")
    try:
        trainer = await run.trainer.cores()
        [generator] = await run.generator.cores()
        engine = generator["engine"]
        for process in (trainer, generator, engine):
            assert process["cpus"] == ALL, process
        assert trainer["threads"] == engine["threads"] == len(ALL)
        batch = [e for group in range(2) for e in await run.rollout(group)]
        generating = [generator["pid"], engine["pid"]]

        async def train():
            await run.trainer.calibrate([batch])  # forward and backward, in the training turn

        async def generate():
            await run.rollout(0)

        while_training = await core_use_while(generating, train)
        while_generating = await core_use_while([trainer["pid"]], generate)
        print(f"cores used: generator {while_training:.3f} while the trainer ran, "
              f"trainer {while_generating:.3f} while the generator ran")  # fmt: skip
        assert while_training < 0.05
        assert while_generating < 0.05
    finally:
        await run.close()


async def test_auto_calibrates_once_picks_the_fastest_and_moves_the_processes(
    tmp_path, monkeypatch, capsys
):
    cache = tmp_path / "calibration.json"
    monkeypatch.setattr(calibration, "cache_path", lambda: cache)
    # The suite's other worker shares the machine: a calibration it disturbed throughout is
    # not cached. The choice and the move are this test's; the noise is the next test's.
    monkeypatch.setattr(load, "read", lambda cpus: load.Reading(0.0, 0.0, 0.0, 0.0, 0.0))
    run = await start(tmp_path / "first", "placement=auto")
    try:
        pipeline = json.loads((run.run_dir / "pipeline.json").read_text())
        key = calibration.cache_key(run.cfg.workload(), len(ALL))
        costs = calibration.load(key)
        assert costs is not None and set(costs.generate_s) == set(costs.train_s) == {1, 2}
        age = run.cfg.buffer.max_policy_age
        options = predict(costs, len(ALL), overlaps(run.cfg.mode, age), age, True)
        assert pipeline["chosen"] == vars(decide(options, costs.spread).chosen)
        assert run.placer.colocated == (pipeline["chosen"]["placement"] == "colocated")
        await run.steps(4)  # the measured figure joins the prediction after the 4th step
        measured = json.loads((run.run_dir / "pipeline.json").read_text())
        assert measured["measured_s_per_step"] > 0
    finally:
        await run.close()

    # Costs under which a split wins (async: the phases overlap, and cores do not help),
    # cached: the next run reads them and moves its processes. They are 100x this machine's
    # (100 s a phase): once measured, the run drops them from the cache.
    flat = dict.fromkeys(calibration.core_counts(len(ALL)), 100.0)
    calibration.save(key, PhaseCosts(flat, flat, dict.fromkeys(flat, 0.0), 0.0))
    capsys.readouterr()  # the first run's lines
    run = await start(tmp_path / "second", "placement=auto", "mode=async")
    try:
        trainer_cores = len(ALL) - 1  # ties go to the first split: one generator core
        assert run.placer.prediction.label == f"split 1+{trainer_cores}"
        assert not run.placer.colocated
        trainer = await run.trainer.cores()
        [generator] = await run.generator.cores()
        assert (trainer["cpus"], trainer["threads"]) == (ALL[:trainer_cores], trainer_cores)
        assert generator["cpus"] == generator["engine"]["cpus"] == ALL[trainer_cores:]
        assert generator["engine"]["threads"] == 1
        assert calibration.load(key) is not None
        # The start line comes first and names no placement; the placement is said once
        # decided, with the cores the processes were moved to.
        said = capsys.readouterr().out.splitlines()
        start_line = next(i for i, line in enumerate(said) if line.startswith("GRPO: "))
        assert "placement" not in said[start_line]
        decided = next(
            i
            for i, line in enumerate(said)
            if line.startswith(f"placement auto (cached): split 1+{trainer_cores}: margin ")
        )
        placed = (
            f"placement split: generator cores {ALL[trainer_cores:]}, "
            f"trainer cores {ALL[:trainer_cores]}"
        )
        assert start_line < decided < said.index(placed)
        await run.steps(4)  # trains on the split; the measured figure is far from 100 s
        measured = json.loads((run.run_dir / "pipeline.json").read_text())
        assert measured["measured_s_per_step"] < 0.8 * run.placer.prediction.seconds_per_step
        assert calibration.load(key) is None
    finally:
        await run.close()


BUSY_S = 5.0  # how long the other process holds a core once the calibration starts
SPIN = "import os, time\nos.sched_setaffinity(0, {{{core}}})\nend = time.time() + {s}\n" \
    "while time.time() < end:\n    pass\n"  # fmt: skip


async def test_auto_beside_a_busy_core_measures_again_or_chooses_as_on_a_quiet_machine(
    tmp_path, monkeypatch, capsys
):
    """A process that is not the run's (started by a shell that exits: not its descendant)
    holds a core for the first BUSY_S seconds of the calibration. The run says a measurement
    was disturbed and measures it again, or chooses what a calibration without it chose; the
    decision line gives the margin and the spread either way."""
    monkeypatch.setattr(calibration, "cache_path", lambda: tmp_path / "calibration.json")
    run = await start(tmp_path / "quiet", "placement=auto")
    try:
        quiet = run.placer.prediction.label
        key = calibration.cache_key(run.cfg.workload(), len(ALL))
    finally:
        await run.close()
    calibration.forget(key)
    measure = calibration.measure

    async def beside_a_busy_core(*args, **kwargs):
        spin = SPIN.format(core=ALL[0], s=BUSY_S)
        subprocess.run(["sh", "-c", f"{sys.executable} -c '{spin}' >/dev/null 2>&1 &"])
        return await measure(*args, **kwargs)

    monkeypatch.setattr(calibration, "measure", beside_a_busy_core)
    capsys.readouterr()  # the quiet run's lines
    run = await start(tmp_path / "busy", "placement=auto")
    try:
        said = capsys.readouterr().out.splitlines()
        decided = next(line for line in said if line.startswith("placement auto ("))
        assert ": margin " in decided or ", inside the spread of " in decided, decided
        disturbed = [line for line in said if " disturbed (other processes took " in line]
        assert disturbed or run.placer.prediction.label == quiet, said
    finally:
        await run.close()
