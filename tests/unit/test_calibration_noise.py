"""Calibration that noise cannot fool (forge/placement/calibration.py, load.py, placer.py): on
a simulated two-core machine, a busy process holding a core for part of the calibration, a
measurement slower on more cores than on fewer, candidates within the spread, the machine
busy throughout; the load reader on /proc/stat text and on this machine; and the run's own
steps checking a cached choice against the runner-up's prediction."""

import functools
import json
import os
import subprocess
import sys
import time

import pytest
from helper_configs import ROOT

from forge.cli import load_app
from forge.config import load_config
from forge.loop.config import overlaps
from forge.loop.plan import plan_run
from forge.placement import calibration, load
from forge.placement.calibration import Samples, Workload
from forge.placement.cost_model import PhaseCosts, decide, predict
from forge.placement.load import Reading
from forge.placement.placer import MEASURED_STEPS, Placer
from forge.placement.plan import ClusterShape

CPU_HOST = ClusterShape(hosts=1, gpus_per_host=0, cpus_per_host=2)

# Seconds in binary fractions, so that simulated time adds up exactly.
SYNC_S = 0.0625  # each of the four syncs; the cost model's S
# Quiet costs on two cores, async: colocated G(2) + T(2) + S = 6.06 s/step, split 1+1
# max(G(1), T(1) + S) = 6.56: colocated, by 0.5 s/step, more than the spread (5%: 0.33).
GENERATE = {2: 3.0, 1: 4.75}
TRAIN = {2: 3.0, 1: 6.5}


class Machine:
    """Two cores in simulated time. Each measurement takes its quiet cost on the cores it is
    given, `slowdown` times that where it starts while a busy process holds a core (one of
    `busy`'s windows), which then shows in the load readings as another process's work."""

    def __init__(self, busy=(), slowdown=2.0, generate=GENERATE, train=TRAIN, jitter=None):
        self.now = 0.0
        self.busy, self.slowdown = busy, slowdown
        self.quiet = {"generate": generate, "train": train}
        self.jitter = jitter or {}  # (kind, cores): factors of its successive measurements
        self.own = self.other = 0.0  # CPU seconds: the run's processes', the busy process's
        self.cores = {"generate": 2, "train": 2}
        self.measured: list[tuple[str, int]] = []  # in the order taken

    def clock(self) -> float:
        return self.now

    def run(self, kind: str) -> float:
        cores = self.cores[kind]
        self.measured.append((kind, cores))
        factors = self.jitter.get((kind, cores), [])
        seconds = self.quiet[kind][cores] * (factors.pop(0) if factors else 1.0)
        if any(start <= self.now < end for start, end in self.busy):
            seconds *= self.slowdown
            self.other += seconds  # it holds one core throughout
        self.own += seconds * cores
        self.now += seconds
        return seconds

    def read(self, cpus: list[int]) -> Reading:
        assert cpus == [0, 1]
        return Reading(self.own + self.other, 0.0, 2 * self.now, self.own, 0.0)

    def processes(self):
        machine = self

        class Process:
            def __init__(self, kind):
                self.kind = kind

            async def use_cores(self, cpus):
                machine.cores[self.kind] = len(cpus)

        return Process("generate"), Process("train")

    def workload(self, read: bool = True) -> Workload:
        async def rollouts(groups, seed_base):
            if groups is None:
                self.run("generate")
            return ["episode"]

        async def train_costs(episodes):
            assert episodes == ["episode"]
            return {"train_s": self.run("train"), "stale_s": 0.0}

        async def sync():
            self.now += SYNC_S

        async def nothing():
            pass

        return Workload(rollouts, train_costs, sync, sync, nothing, self.read if read else None)


def decider(costs: PhaseCosts):
    return decide(predict(costs, 2, overlaps("async", 1), 1, exact_mismatch=False), costs.spread)


async def calibrate(machine: Machine, read: bool = True):
    said: list[str] = []
    generator, trainer = machine.processes()
    measured = await calibration.measure(
        generator, trainer, machine.workload(read), [0, 1], decider, said.append, machine.clock
    )
    assert machine.cores == {"generate": 2, "train": 2}  # both back on every core
    return measured, decider(measured.costs), said


ROUND = [("generate", 2), ("generate", 1), ("train", 2), ("train", 1)]
AGAIN = [("generate", 1), ("generate", 2), ("train", 1), ("train", 2)]  # the other order


async def test_a_quiet_machine_measures_each_once_and_decides_by_the_margin():
    measured, decision, said = await calibrate(Machine())
    assert said == [] and not measured.disturbed
    assert measured.costs == PhaseCosts(GENERATE, TRAIN, {1: 0.0, 2: 0.0}, SYNC_S, 0.0)
    assert decision.chosen.label == "colocated"
    assert decision.line() == "colocated: margin 0.5 s/step over split 1+1, spread 0.3 s/step (5%)"


async def test_a_busy_core_during_part_of_the_calibration_is_measured_again():
    """Training on both cores starts while a busy process holds a core (2x slower): unseen, it
    would make the split look faster. The run says so and measures it again once the machine
    is quiet, then measures both candidates again in the other order."""
    quiet = (await calibrate(Machine()))[1]
    # Generation is measured first (3.0 + 4.75 s after the syncs, 0.25 s); training next.
    busy = [(7.5, 12.0)]
    blind = await calibrate(Machine(busy), read=False)
    assert blind[1].chosen.label == "split 1+1"  # what the disturbance would have chosen
    machine = Machine(busy)
    measured, decision, said = await calibrate(machine)
    assert said[0].startswith("calibration: training on 2 cores disturbed (other processes ")
    assert said == [said[0]]  # once: the second try is quiet
    assert machine.measured == [*ROUND[:3], ("train", 2), ROUND[3], *AGAIN]
    assert not measured.disturbed and measured.costs.train_s == TRAIN
    assert decision.chosen == quiet.chosen and decision.line() == quiet.line()


async def test_work_slower_on_more_cores_than_on_fewer_is_measured_again():
    """The install running beside `make grpo`: generation on 2 cores measured slower than on
    1, with no load readings to tell."""
    machine = Machine(busy=[(0.1, 1.0)])  # the first generation on 2 cores: 6.0 s
    measured, decision, said = await calibrate(machine, read=False)
    assert said == [
        "calibration: generation on 2 cores came out slower than on fewer: measured again"
    ]
    assert machine.measured == [*ROUND, ("generate", 2), *AGAIN]
    assert measured.costs.generate_s == GENERATE  # the slower of the two refused
    assert decision.chosen.label == "colocated"


async def test_candidates_within_the_spread_are_measured_again_and_colocated_wins():
    """Split 1+1 predicted faster by 0.1 s/step: inside the spread. The second round's
    measurements of training on one core come 10% apart: the measured spread."""
    train = {2: 3.0, 1: 5.875}  # split: max(4.75, 5.94) against colocated 6.06
    machine = Machine(train=train, jitter={("train", 1): [1.0, 1.1]})
    measured, decision, said = await calibrate(machine)
    assert said == [] and machine.measured == ROUND + AGAIN
    assert measured.costs.train_s == train  # the fastest of each
    assert measured.costs.spread == pytest.approx(0.1)
    assert decision.chosen.label == "colocated"
    assert decision.line() == (
        "colocated: split 1+1 is faster by a margin of 0.1 s/step, inside the spread of "
        "0.6 s/step (10%): the simpler placement wins"
    )


async def test_a_machine_busy_throughout_keeps_the_fastest_try_and_says_so():
    machine = Machine(busy=[(0.0, 1e9)])
    measured, _, said = await calibrate(machine)
    assert measured.disturbed
    tries = calibration.MAX_TRIES
    assert machine.measured[:tries] == [("generate", 2)] * tries
    assert said[tries] == (
        f"calibration: generation on 2 cores kept after {tries} disturbed measurements; "
        "these costs will not be cached"
    )


def test_samples_keep_the_fastest_and_spread_of_each_kind_and_core_count():
    samples = Samples()
    for kind, cores, seconds in (("generate", 2, 5.6), ("generate", 1, 4.8),
                                 ("generate", 2, 4.0), ("train", 2, 10.0)):  # fmt: skip
        phases = calibration.PHASES[kind]
        samples.add(kind, cores, dict.fromkeys(phases, seconds))
    assert samples.spread() == pytest.approx(0.4)
    assert samples.slower_with_more_cores() == []  # 4.0 on 2 cores: not slower than 4.8
    samples.drop_slowest("generate", 2)
    assert samples.spread() == 0.0
    samples.add("generate", 2, {"generate_s": 5.2})
    samples.drop_slowest("generate", 2)  # the 5.2 goes, the 4.0 stays
    assert samples.costs(0.5) == PhaseCosts({2: 4.0, 1: 4.8}, {2: 10.0}, {2: 10.0}, 0.5, 0.0)
    samples.add("train", 1, {"train_s": 9.0, "stale_s": 1.0})  # 10.0 on 2 cores: slower
    assert samples.slower_with_more_cores() == [("train", 2)]


STAT = """cpu  300 0 60 500 20 0 5 15 0 0
cpu0 100 0 20 300 10 0 2 5 0 0
cpu1 200 0 40 200 10 0 3 10 0 0
intr 12345
"""


def test_the_reader_sums_the_run_cores_of_proc_stat():
    assert load.parse_stat(STAT, [1]) == (240, 10, 463)
    assert load.parse_stat(STAT, [0, 1]) == (360, 15, 900)


def test_a_measurement_is_disturbed_where_other_work_took_the_cores():
    before = Reading(busy=100.0, steal=0.0, total=200.0, own=50.0, rounding=0.1)
    ours = Reading(busy=119.0, steal=0.0, total=220.0, own=68.5, rounding=0.1)
    assert load.disturbance(before, ours) is None  # 0.5 s of 20: daemons, interrupts
    other = Reading(busy=120.0, steal=0.0, total=220.0, own=60.0, rounding=0.1)
    assert load.disturbance(before, other) == (
        "other processes took 50% of the cores' time, the hypervisor 0%"
    )
    stolen = Reading(busy=118.0, steal=4.0, total=220.0, own=68.0, rounding=0.1)
    assert load.disturbance(before, stolen) == (
        "other processes took 0% of the cores' time, the hypervisor 20%"
    )
    assert load.disturbance(before, before) is None


# Works `s` CPU seconds, however long the machine takes to give them.
SPIN = "import time\nwhile time.process_time() < {s}:\n    pass\n"


def test_the_reader_tells_the_run_own_work_from_another_process():
    """On this machine: this process's children are the run's; a process it did not start (a
    child's child, left to init) is another's. The machine may be busy with other work
    already: only what each adds is compared."""
    core = str(sorted(os.sched_getaffinity(0))[0])
    spin = [sys.executable, "-c", SPIN.format(s=0.5)]
    before = load.read([int(core)])
    subprocess.run(["taskset", "-c", core, *spin], check=True)
    after = load.read([int(core)])
    assert after.own - before.own >= 0.45  # the child's CPU time, counted once reaped
    orphan = f"taskset -c {core} {sys.executable} -c '{SPIN.format(s=0.5)}' & echo $!"
    start = load.read([int(core)])
    pid = int(subprocess.run(["sh", "-c", orphan], capture_output=True, check=True).stdout)
    while os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)
    end = load.read([int(core)])
    assert end.own - start.own < 0.2
    assert load.disturbance(start, end) is not None


async def test_work_genuinely_slower_on_more_cores_is_kept_after_the_retries():
    """A model so small that two threads cost more than they save: the measurements agree, so
    the costs are kept (and cached) as measured."""
    generate = {2: 5.0, 1: 4.0}
    machine = Machine(generate=generate)
    measured, _, said = await calibrate(machine)
    tries = calibration.MAX_TRIES
    assert said[-1] == "calibration: generation on 2 cores stays slower than on fewer"
    assert len(said) == tries  # each retry said, then the verdict, once
    assert measured.costs.generate_s == generate and not measured.disturbed


# The in-run check, on cached costs under which split 1+1 wins by 2.0 s/step (colocated
# G(2) + T(2) + S = 31.0, split max(G(1), T(1) + S) = 29.0; spread 5% of 31.0: 1.55).
SPLIT_WINS = PhaseCosts({2: 10.0, 1: 29.0}, {2: 20.5, 1: 28.0}, {2: 0.0, 1: 0.0}, 0.5)
KEY = ("workload",)


def placer(tmp_path, monkeypatch, machine, *overrides: str) -> tuple[Placer, list[str]]:
    """A placer of configs/grpo/smollm2_cpu.yaml on two cores, whose calibration (cached under
    `tmp_path`) times generation on the simulated `machine`'s clock."""
    monkeypatch.setattr(calibration, "cache_path", lambda: tmp_path / "calibration.json")
    measure = functools.partial(calibration.measure, clock=machine.clock)
    monkeypatch.setattr(calibration, "measure", measure)
    schema = load_app(ROOT / "apps/grpo/main.py")[1]
    cfg = load_config(schema, ROOT / "configs/grpo/smollm2_cpu.yaml", list(overrides))
    said: list[str] = []
    return Placer(plan_run(cfg, CPU_HOST), said.append, tmp_path / "pipeline.json"), said


async def fit(placer: Placer, machine: Machine) -> None:
    generator, trainer = machine.processes()
    generator.cpus = trainer.cpus = _cpus
    await placer.fit(generator, trainer, machine.workload(), KEY, overlap=True,
                     max_policy_age=1, exact_mismatch=False)  # fmt: skip


async def _cpus() -> list[int]:
    return [0, 1]


async def test_auto_says_margin_and_spread_and_caches_a_quiet_calibration(tmp_path, monkeypatch):
    machine = Machine()
    auto, said = placer(tmp_path, monkeypatch, machine)
    await fit(auto, machine)
    assert said[1].splitlines()[0] == (
        "placement auto (calibrated in 0s): colocated: margin 0.5 s/step over split 1+1, "
        "spread 0.3 s/step (5%)"
    )
    key = calibration.cache_key(KEY, 2)
    assert calibration.load(key) == PhaseCosts(GENERATE, TRAIN, {1: 0.0, 2: 0.0}, SYNC_S)
    record = json.loads((tmp_path / "pipeline.json").read_text())
    assert record["margin_s"] == -0.5 and record["spread_s"] == pytest.approx(0.05 * 6.5625)


async def test_a_calibration_disturbed_throughout_is_not_cached(tmp_path, monkeypatch):
    machine = Machine(busy=[(0.0, 1e9)])
    auto, said = placer(tmp_path, monkeypatch, machine)
    await fit(auto, machine)
    decided = next(line for line in said if line.startswith("placement auto ("))
    assert decided.startswith(
        "placement auto (calibrated in 0s, disturbed: not cached, the next run measures again): "
    )
    assert "margin" in decided and "spread" in decided
    assert calibration.load(calibration.cache_key(KEY, 2)) is None


def steps(placer: Placer, seconds: float) -> None:
    for _ in range(MEASURED_STEPS + 1):
        placer.measured(seconds)


async def test_a_run_whose_steps_show_the_runner_up_faster_drops_the_cached_choice(
    tmp_path, monkeypatch
):
    """The split ran 1.19x its prediction, inside what the run tolerates of a prediction, but
    slower than colocated's prediction by more than the spread: the choice was wrong."""
    machine = Machine()
    auto, said = placer(tmp_path, monkeypatch, machine)
    calibration.save(calibration.cache_key(KEY, 2), SPLIT_WINS)
    await fit(auto, machine)
    assert said[0].splitlines()[0] == (
        "placement auto (cached): split 1+1: margin 2.0 s/step over colocated, spread 1.6 "
        "s/step (5%)"
    )
    assert machine.cores == {"generate": 1, "train": 1} and not auto.colocated
    steps(auto, 34.5)
    assert said[1:] == [
        "placement split 1+1: measured 34.5 s/step (median of 3 steps), predicted 29.0 "
        "(1.19x); colocated predicted 31.0",
        "placement: colocated's prediction is faster than the step measured by more than the "
        "spread (1.6 s/step): the cached phase costs are dropped; the next auto run measures "
        "them",
    ]
    assert calibration.load(calibration.cache_key(KEY, 2)) is None


@pytest.mark.parametrize("placement", ["auto", "split"])
async def test_a_run_whose_steps_bear_the_choice_out_keeps_it(placement, tmp_path, monkeypatch):
    """Under auto, a step slower than predicted but not slower than the runner-up's
    prediction by more than the spread; under an explicit split, the runner-up is no choice
    the run made."""
    machine = Machine()
    run, said = placer(tmp_path, monkeypatch, machine, f"placement={placement}")
    calibration.save(calibration.cache_key(KEY, 2), SPLIT_WINS)
    await fit(run, machine)
    steps(run, 32.0 if placement == "auto" else 34.5)
    assert calibration.load(calibration.cache_key(KEY, 2)) == SPLIT_WINS
    assert len(said) == 2
