"""Bench result files and the page generated from them (bench/result.py, bench/report.py)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    """A module of bench/ (not a package), loaded by path: bench/ stays off sys.path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load("report")
result = _load("result")


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(result, "FOLDER", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    return tmp_path


def test_a_result_file_holds_machine_commit_date_command_and_figures(results):
    path = (
        result.Result("service_overhead")
        .figure("p50 latency, raw actor", 1.23456, "ms")
        .ratio("service / raw actor p50 latency", 1.0149, target="<= 1.2", headline=True)
        .write()
    )
    assert path == results / "service_overhead.json"
    data = json.loads(path.read_text())
    assert data["bench"] == "service_overhead"
    assert data["command"].startswith("python ")
    assert data["date"].endswith("Z")
    assert len(data["commit"]["sha"]) == 40 and isinstance(data["commit"]["dirty"], bool)
    machine = data["machine"]
    assert machine["cores"] >= machine["cores_usable"] >= 1
    assert machine["cpu"] and machine["memory_gb"] > 0 and len(machine["load_average"]) == 3
    assert data["figures"] == [
        {"name": "p50 latency, raw actor", "value": 1.235, "unit": "ms"},
        {
            "name": "service / raw actor p50 latency",
            "value": 1.015,
            "unit": "ratio",
            "target": "<= 1.2",
            "headline": True,
        },
    ]


def test_the_page_shows_each_result_with_its_provenance_and_the_rest_as_not_recorded(results):
    result.Result("checkpoint").ratio("background / blocking", 0.25, headline=True).write()
    page = report.page()
    assert page.startswith("# Benchmarks\n") and "generated" in page.split("## ")[0]
    section = page.split("## checkpoint\n")[1].split("\n## ")[0]
    assert "[bench/results/checkpoint.json](../bench/results/checkpoint.json)" in section
    assert "Measured on " in section and "; commit `" in section and " UTC;" in section
    assert "| **background / blocking** | 0.25 |  |" in section
    generator = page.split("## generator\n")[1].split("\n## ")[0]
    assert "No result recorded yet: `python bench/generator.py`." in generator
    readme = report.readme(
        "x\n<!-- headline ratios: make bench-report -->\nold\n<!-- /headline ratios -->\n"
    )
    assert "old" not in readme
    assert "- background / blocking: **0.25**, [bench/results/checkpoint.json]" in readme


def test_every_bench_is_listed_and_the_page_and_readme_are_up_to_date():
    """`make bench-report` was run after the last bench run (and nobody edited the page)."""
    assert report.unlisted() == []
    assert report.PAGE.read_text() == report.page(), "run `make bench-report`"
    assert report.README.read_text() == report.readme(report.README.read_text())


@pytest.mark.parametrize("ending", ["return", "raise SystemExit(3)", "raise KeyboardInterrupt"])
def test_a_benchs_scratch_folder_is_removed_when_it_exits(ending, tmp_path):
    """Run folders written under scratch_folder are gone once the bench exits, however."""
    code = (
        "import sys; sys.path.insert(0, 'bench'); from scratch import scratch_folder\n"
        f"def main():\n    f = scratch_folder('t'); (f / 'run').mkdir(); print(f)\n    {ending}\n"
        "main()"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True)
    folder = Path(done.stdout.decode().strip())
    assert folder.parent == tmp_path and folder.name.startswith("forge-bench-t-")
    assert not folder.exists()
