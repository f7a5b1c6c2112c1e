"""The test suite: how long `make test` takes on this machine, and where the time goes.

Runs `make test` with `--durations=0` added (CI's `FORGE_NO_SKIPS=1` set), or reads
the output of such a run (`--log`), and records: the wall time; each tier's test time (unit,
integration, e2e: the sum of its tests' setup, call and teardown, on whichever worker ran
them); the SmolLM2 learning tests' share of it; how fully the workers were used (test time /
workers x wall); the slowest files; the failed tests, if any (a failed test's time is what it
ran before failing); and, for a run it started, how busy the cores were (/proc/stat over the
run). It exits with pytest's status once the result is written. The ratios say whether a
faster suite needs less work (busy cores, full workers) or better packing (idle workers at the
end).

    python bench/suite.py [--log OUTPUT] [-- PYTEST_ARGS ...]
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from result import ROOT, Result

WORKERS = 2  # `make test`'s -n
DURATION = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+tests/(\w+)/([^:\s]+)")
WALL = re.compile(r" in ([0-9.]+)s(?: \(|$)")
FAILED = re.compile(r"(\d+) failed")
LEARNING = "e2e/test_learning"  # the SmolLM2 learning tests: test_learning.py


def busy_cpu_s() -> float:
    """CPU-seconds every core has spent busy since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_suite(pytest_args: list[str]) -> tuple[str, float, float, int]:
    """Runs the suite, its output passed through; the output, wall seconds, busy CPU-seconds
    and pytest's exit status."""
    env = {**os.environ, "FORGE_NO_SKIPS": "1"}
    busy, start = busy_cpu_s(), time.monotonic()
    extra = shlex.join(["--durations=0", *pytest_args])  # pytest takes the last --durations
    proc = subprocess.Popen(
        ["make", "test", f"PYTEST_ARGS={extra}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    status = proc.wait()
    return "".join(lines), time.monotonic() - start, busy_cpu_s() - busy, status


def record(output: str, wall_s: float | None, busy_s: float | None) -> Result:
    """The figures of one suite run's output."""
    files: Counter[str] = Counter()
    for line in output.splitlines():
        if m := DURATION.match(line.strip()):
            files[f"{m[2]}/{m[3]}"] += float(m[1])
    if not files:
        raise SystemExit("suite: no --durations=0 lines in the output")
    summary = next(line for line in reversed(output.splitlines()) if WALL.search(line))
    if wall_s is None:
        wall_s = float(WALL.search(summary)[1])
    failed = FAILED.search(summary)
    total = sum(files.values())
    tiers: Counter[str] = Counter()
    for path, seconds in files.items():
        tiers[path.split("/")[0]] += seconds
    learning = sum(s for path, s in files.items() if path.startswith(LEARNING))
    result = Result("suite")
    result.figure("wall", wall_s / 60, "min", target="<= 45")
    result.figure("failed tests", int(failed[1]) if failed else 0, "tests", target="0")
    for tier in ("unit", "integration", "e2e"):
        if tier in tiers:
            result.figure(f"{tier} tests, summed", tiers[tier] / 60, "min")
    result.figure("SmolLM2 learning tests, summed", learning / 60, "min")
    result.ratio("learning tests / all tests", learning / total)
    result.ratio(f"tests summed / ({WORKERS} workers x wall)", total / (WORKERS * wall_s))
    if busy_s is not None:
        result.ratio("busy CPU / (cores x wall)", busy_s / ((os.cpu_count() or 1) * wall_s))
    for path, seconds in files.most_common(8):
        result.figure(f"slowest files: {path}", seconds, "s")
    for figure in result.figures:
        print(f"{figure['name']}: {figure['value']} {figure['unit']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, help="a finished run's output, read, not run")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args()
    if args.log is not None:
        record(args.log.read_text(), None, None).write()
        return
    output, wall_s, busy_s, status = run_suite(args.pytest_args)
    record(output, wall_s, busy_s).write()
    raise SystemExit(status)


if __name__ == "__main__":
    main()
