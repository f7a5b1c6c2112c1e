"""The machine's load around a measurement: whether a calibration's timing shared the run's
cores with work that is not the run's.

A reading holds the CPU seconds the run's cores spent working and had stolen by the
hypervisor (`/proc/stat`), and those the run's own processes used: this process and its
descendants, the actors and their engines wherever the hosts are this machine's processes
(the local and process launchers). Between two readings, the cores' work beyond the run's own
is another process's. `/proc/loadavg` cannot tell the two apart: it counts the run's own
threads, and it is an average over a minute that moves in five-second steps, so it barely
stirs during a measurement of seconds.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

# The share of the run's cores' time that may go to other work (other processes, the
# hypervisor) while a measurement runs. Past it, the work slowed by more than the spread a
# margin must clear (cost_model.MIN_SPREAD); a quiet machine's daemons and interrupts take
# far less.
DISTURBED = 0.1


@dataclass(frozen=True)
class Reading:
    """CPU seconds since boot, at one moment.

    Args:
        busy: the run's cores, running processes (user, nice, system).
        steal: the run's cores, taken by the hypervisor for other virtual machines.
        total: the run's cores, all of it (working, idle, waiting for I/O, stolen).
        own: this process and its descendants, working, their reaped children included.
        rounding: how far a difference of `own` may be off: each process's counters hold
            whole ticks.
    """

    busy: float
    steal: float
    total: float
    own: float
    rounding: float


def read(cpus: list[int]) -> Reading:
    """The machine's reading for the cores `cpus` now."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    busy, steal, total = parse_stat(Path("/proc/stat").read_text(), cpus)
    own, processes = _own_seconds()
    # Two counters per process (user, system) that a window's difference may miss a tick of.
    return Reading(busy * tick, steal * tick, total * tick, own, 2 * processes * tick)


def parse_stat(text: str, cpus: list[int]) -> tuple[int, int, int]:
    """Ticks of the cores `cpus` in `/proc/stat`'s `text`: working, stolen, in all."""
    wanted = {f"cpu{c}" for c in cpus}
    busy = steal = total = 0
    for line in text.splitlines():
        name, *fields = line.split()
        if name not in wanted:
            continue
        # user nice system idle iowait irq softirq steal (guest time is inside user's).
        # Interrupts are left out: no process's time holds them, the run's own included.
        user, nice, system, *_, stolen = map(int, fields[:8])
        busy += user + nice + system
        steal += stolen
        total += sum(map(int, fields[:8]))
    return busy, steal, total


def disturbance(before: Reading, after: Reading) -> str | None:
    """What else ran on the run's cores between `before` and `after`, in a few words, where
    it took more than DISTURBED of their time; None where the measurement had them."""
    total = after.total - before.total
    if total <= 0:
        return None
    other = max(after.busy - before.busy - (after.own - before.own), 0.0)
    steal = after.steal - before.steal
    if other + steal <= DISTURBED * total + max(before.rounding, after.rounding):
        return None
    return (
        f"other processes took {other / total:.0%} of the cores' time, the hypervisor "
        f"{steal / total:.0%}"
    )


def _own_seconds() -> tuple[float, int]:
    """Seconds this process and its descendants worked, and how many processes that is."""
    me = psutil.Process()
    seconds, counted = 0.0, 0
    for process in [me, *me.children(recursive=True)]:
        try:
            t = process.cpu_times()
        except psutil.Error:  # it ended meanwhile: its parent counts it once it is reaped
            continue
        seconds += t.user + t.system + t.children_user + t.children_system
        counted += 1
    return seconds, counted
