"""Chaos: a seeded schedule that SIGKILLs one role's process after another in a running
`forge run`, the driver itself included, and starts the same command again where a kill ended
the run. Used by tests/e2e/test_chaos.py and bench/chaos.py's soak.

A kill waits for the run to have logged a step after the previous kill (it recovered: a row
written later than the kill, not one of a step that was finishing as it landed), then for a
seeded delay: kills land at varied points of a step, never on a run that has not recovered
from the last one, however slow the machine. A run needs about two steps a kill
(`steps_for`).
"""

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from helper_runs import console, descendants, forge_run, metrics, processes_of


def _monarch(mesh: str) -> Callable[[int], list[int]]:
    """The driver's Monarch processes of proc meshes named `<mesh>-<n>` (any n: a respawned
    replica's mesh may be numbered anew); not the processes they started."""

    def find(driver: int) -> list[int]:
        found = []
        for p in descendants(driver):
            try:
                name, command = p.environ().get("HYPERACTOR_PROCESS_NAME", ""), p.cmdline()
            except psutil.NoSuchProcess:
                continue  # ended meanwhile
            if name.startswith(f"{mesh}-") and name.endswith(f" @ {socket.gethostname()}"):
                if "bootstrap_main" in " ".join(command):
                    found.append(p.pid)
        return found

    return find


# Each role a GRPO run with environments, reward functions and a KL reference starts, and how
# its processes are found among the driver's descendants.
ROLES: dict[str, Callable[[int], list[int]]] = {
    "generator": _monarch("generator"),
    "environment": _monarch("environmentactor"),
    "reward service": _monarch("rewardactor"),
    "reward worker": lambda driver: processes_of(driver, "reward_runner"),
    "dataset": _monarch("datasetactor"),
    "reference": _monarch("referencemodel"),
    "trainer": _monarch("titantrainer"),
    "replay buffer": _monarch("replaybuffer"),
    "driver": lambda driver: [driver],
}
# Whose death ends the run (docs/run_folder.md, "When a process dies"): the command is run again.
ENDS_RUN = frozenset({"replay buffer", "driver"})


def steps_for(kills: int) -> int:
    """Steps a run needs for `kills` kills: one to recover from each, about one that the delay
    before the next lets pass, and a few to start and end."""
    return 2 * kills + 4


def agent_run(run_dir: Path, steps: int, kills: int) -> subprocess.Popen:
    """A tiny async GRPO run that starts every role of ROLES: guess-a-number in two environment
    replicas, a reward function, a KL reference; a checkpoint each step, and a trainer restart
    allowed for each kill."""
    return forge_run(
        "grpo",
        "configs/agent/tiny_cpu.yaml",
        run_dir,
        "reward.functions=[helper_rewards:vowel_fraction]",
        "trainer.loss.kl_coef=0.01",
        "reference={model: tiny-llama}",
        f"steps={steps}",
        f"max_trainer_restarts={kills}",
        "trainer.checkpoint.interval=1",
        "eval.interval=0",
        "export_hf=false",
    )


@dataclass
class Kill:
    """One kill: the role, the step the run had logged, and how long until it logged another."""

    role: str
    pid: int
    at_step: int
    at: float = field(default_factory=time.monotonic)
    wall: float = field(default_factory=time.time)  # comparable with metrics rows' "time"
    recovered_s: float = 0.0
    ended_run: bool = False


@dataclass
class Chaos:
    """Runs `start()` (a `forge run` of `run_dir`, a new process group) to its end, killing
    roles on the way: the first `len(ROLES)` kills take every role once, in a seeded order;
    later ones a seeded random role. `kills` says how many in all."""

    start: Callable[[], subprocess.Popen]
    run_dir: Path
    kills: int
    seed: int = 0
    max_delay_s: float = 2.0
    timeout_s: float = 900.0
    done: list[Kill] = field(default_factory=list)
    seen: set[tuple[int, float]] = field(default_factory=set)  # (pid, start): every process
    consoles: list[str] = field(default_factory=list)  # each driver's console, in order

    def schedule(self) -> list[str]:
        rng = random.Random(self.seed)
        first = rng.sample(list(ROLES), len(ROLES))
        return (first + [rng.choice(list(ROLES)) for _ in range(self.kills)])[: self.kills]

    def run(self) -> int:
        """Kills as scheduled, then waits for the run to finish; its exit status."""
        rng = random.Random(self.seed + 1)
        proc = self.start()
        try:
            self._wait_for_a_step_after(proc, 0.0)
            for role in self.schedule():
                time.sleep(rng.uniform(0, self.max_delay_s))  # where in a step it lands
                proc = self._kill(proc, role)
                self._wait_for_a_step_after(proc, self.done[-1].wall)
                self.done[-1].recovered_s = time.monotonic() - self.done[-1].at
            deadline = time.monotonic() + self.timeout_s
            while (code := proc.poll()) is None:  # noting what it starts to its end
                self._family(proc.pid)
                assert time.monotonic() < deadline, "the run did not end"
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            self.consoles.append(console(self.run_dir))
        return code

    def _kill(self, proc: subprocess.Popen, role: str) -> subprocess.Popen:
        assert proc.poll() is None, f"the run ended before kill {len(self.done) + 1}: more steps"
        family = self._family(proc.pid)  # before: a dead driver's children are no longer its
        victims = ROLES[role](proc.pid)
        assert victims, f"no {role} process to kill"
        victim = random.Random(self.seed + len(self.done)).choice(victims)
        self.done.append(Kill(role, victim, self._steps()))
        os.kill(victim, signal.SIGKILL)
        print(f"chaos: killed the {role} (pid {victim}) after step {self.done[-1].at_step}")
        if role not in ENDS_RUN:
            return proc
        self.done[-1].ended_run = True
        proc.wait(timeout=self.timeout_s)  # the buffer's death ends the run by itself
        self.consoles.append(console(self.run_dir))
        # The driver's processes end with it (parent-death signal), the buffer's run stops them.
        gone, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, f"left running after the {role} died: {[p.pid for p in alive]}"
        return self.start()  # the same command

    def _wait_for_a_step_after(self, proc: subprocess.Popen, wall: float) -> None:
        """Until the run logs a step later than `wall` (time.time())."""
        deadline = time.monotonic() + self.timeout_s
        while not any(row["time"] > wall for row in self._rows()):
            assert proc.poll() is None, f"the run ended: {console(self.run_dir)[-1500:]}"
            self._family(proc.pid)  # noted in `seen` while it runs
            assert time.monotonic() < deadline, "no step after the kill"
            time.sleep(0.2)

    def _rows(self) -> list[dict]:
        return metrics(self.run_dir) if (self.run_dir / "metrics.jsonl").exists() else []

    def _steps(self) -> int:
        return len(self._rows())

    def _family(self, driver: int) -> list[psutil.Process]:
        """The driver and its descendants, each noted in `seen`."""
        family = [psutil.Process(driver), *descendants(driver)]
        for p in family:
            try:
                self.seen.add((p.pid, p.create_time()))
            except psutil.NoSuchProcess:
                pass
        return family

    def left_running(self, timeout: float = 30.0) -> list[int]:
        """Processes of the run seen alive during it that still run `timeout` seconds on (those
        just exiting are given that long; a zombie has ended)."""
        ours = []
        for pid, created in self.seen:
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and _running(p):
                    ours.append(p)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(ours, timeout=timeout)
        return [p.pid for p in alive if _running(p)]


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
