"""Rebuilds docs/benchmarks.md from the result files in bench/results/ (`make bench-report`).

One section per bench (and per variant that measures something else, as `--lora`): what it
measures, the command, and its latest result file's figures with the machine, commit and date
they were measured on, linked to the file; "no result recorded yet" and the command where no
run wrote one. It also rewrites the README's headline ratios (the figures a bench marks
`headline`), between the README's two `headline ratios` markers, each linked to its file.
Figures are only ever read here, never written: a result file comes from a bench run alone.

    python bench/report.py [--check]   # --check: fail if a page differs from what it would write
"""

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
HEADLINES = re.compile(
    r"(<!-- headline ratios: make bench-report -->\n)(.*?)(<!-- /headline ratios -->)", re.S
)

# Each result file's name, the command that writes it, and the bench it comes from, in the
# order the page shows them. A bench's own description is its docstring's first line.
BENCHES = [
    ("service_overhead", "python bench/service_overhead.py", "service_overhead"),
    ("generator", "python bench/generator.py", "generator"),
    ("generator-lora", "python bench/generator.py --lora", "generator"),
    ("weight_sync", "python bench/weight_sync.py", "weight_sync"),
    ("weight_sync-lora", "python bench/weight_sync.py --lora", "weight_sync"),
    ("weight_sync-nodes", "python bench/weight_sync.py --across-nodes", "weight_sync"),
    ("checkpoint", "python bench/checkpoint.py", "checkpoint"),
    ("trainer_flops", "python bench/trainer_flops.py", "trainer_flops"),
    ("trainer_memory", "python bench/trainer_memory.py", "trainer_memory"),
    ("async_speedup", "python bench/async_speedup.py", "async_speedup"),
    ("placement", "python bench/placement.py", "placement"),
    ("step_profile", "python bench/step_profile.py", "step_profile"),
    ("before_after", "python bench/before_after.py", "before_after"),
    ("precision", "python bench/precision.py", "precision"),
    ("single_process", "python bench/single_process.py", "single_process"),
    ("startup", "python bench/startup.py", "startup"),
    ("distill_throughput", "python bench/distill_throughput.py", "distill_throughput"),
    ("environments", "python bench/environments.py", "environments"),
    ("episode_rollouts", "python bench/episode_rollouts.py", "episode_rollouts"),
    ("record", "python bench/record.py", "record"),
    ("chaos", "python bench/chaos.py", "chaos"),
    ("attach", "python bench/attach.py", "attach"),
    ("tinker_overhead", "python bench/tinker_overhead.py", "tinker_overhead"),
    ("suite", "python bench/suite.py", "suite"),
]
VARIANTS = {
    "generator-lora": "what serving a LoRA adapter costs the Generator",
    "weight_sync-lora": "weight sync of full weights against a LoRA adapter, and merged",
    "weight_sync-nodes": "torchstore between two SLURM nodes (network namespaces), against raw TCP",
}


def description(bench: str) -> str:
    """The first paragraph of the bench's docstring."""
    tree = ast.parse((ROOT / "bench" / f"{bench}.py").read_text())
    return " ".join(ast.get_docstring(tree).split("\n\n")[0].split()).rstrip(".")


def number(value: float) -> str:
    size = abs(value)
    if value == 0 or 0.001 <= size < 10:
        return f"{value:.3g}"
    if size < 100:
        return f"{value:.1f}"
    if size < 1e6:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def with_unit(figure: dict) -> str:
    unit = figure["unit"]
    return number(figure["value"]) + ("" if unit == "ratio" else f" {unit}")


def provenance(result: dict) -> str:
    m, c = result["machine"], result["commit"]
    cores = f"{m['cores']} cores" + (
        f" ({m['cores_usable']} usable)" if m["cores_usable"] != m["cores"] else ""
    )
    gpus = f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else ""
    dirty = " with uncommitted changes" if c["dirty"] else ""
    date = result["date"].replace("T", " ").removesuffix("Z") + " UTC"
    load = m.get("load_average")
    busy = (
        f"; load average as it ended {load[0]:.1f} / {load[1]:.1f} (1 / 5 minutes, the bench's "
        "own processes included)"
        if load
        else ""
    )
    return (
        f"{m['cpu']}, {cores}, {m['memory_gb']} GiB{gpus}; commit `{c['sha'][:10]}`{dirty}; "
        f"{date}; the run took {result['wall_s']:.0f} s{busy}"
    )


def section(name: str, command: str, bench: str) -> list[str]:
    title = VARIANTS.get(name) or description(bench)
    lines = [f"## {name}", "", f"{title}.", ""]
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return [*lines, f"No result recorded yet: `{command}`.", ""]
    result = json.loads(path.read_text())
    link = f"[bench/results/{path.name}](../bench/results/{path.name})"
    lines += [
        f"`{result['command']}` -> {link}",
        "",
        f"Measured on {provenance(result)}.",
        "",
        "| figure | value | target |",
        "|---|---|---|",
    ]
    for f in result["figures"]:
        name = f"**{f['name']}**" if f.get("headline") else f["name"]
        lines.append(f"| {name} | {with_unit(f)} | {f.get('target', '')} |")
    drawing = path.with_suffix(".png")  # what the bench drew of the same run, if it draws
    if drawing.exists():
        lines += ["", f"![{path.stem}](../bench/results/{drawing.name})"]
    return [*lines, ""]


def page() -> str:
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `make bench-report` (bench/report.py) from bench/results/*.json;"
        " edit those, not this page. -->",
        "",
        "This page is generated: `make bench-report` rebuilds it from the result files in",
        "[bench/results/](../bench/results/). Each bench writes `bench/results/<name>.json` when",
        "it runs, `<name>` being the bench's file name (`<bench>-lora` for a `--lora` run): its",
        "figures with the machine, the commit, the date and the command behind them. A new run",
        "replaces the file (git keeps the earlier ones); a run that fails writes nothing. Each",
        "section below is one result file. Figures in bold are the ratios the README quotes.",
        "",
        "Run a bench with `.venv/bin/python bench/<bench>.py`; it prints its figures, sends what",
        "vLLM, Monarch and torch print to a log file whose path it prints first, and ends by",
        "writing its result file. Then `make bench-report`.",
        "",
    ]
    for name, command, bench in BENCHES:
        lines += section(name, command, bench)
    return "\n".join(lines).rstrip("\n") + "\n"


def headlines() -> str:
    lines = []
    for name, _, _ in BENCHES:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        for f in result["figures"]:
            if f.get("headline"):
                target = f" (target {f['target']})" if f.get("target") else ""
                lines.append(
                    f"- {f['name']}: **{with_unit(f)}**{target}, "
                    f"[bench/results/{path.name}](bench/results/{path.name})"
                )
    return "\n".join(lines) + "\n" if lines else "- none recorded yet\n"


def readme(text: str) -> str:
    if not HEADLINES.search(text):
        raise SystemExit("README.md has no `<!-- headline ratios: make bench-report -->` block")
    return HEADLINES.sub(lambda m: m[1] + headlines() + m[3], text)


def unlisted() -> list[str]:
    """Bench scripts (every bench/*.py but the helpers) not in BENCHES."""
    listed = {bench for _, _, bench in BENCHES} | {"library_log", "result", "report", "scratch"}
    return [p.stem for p in sorted((ROOT / "bench").glob("*.py")) if p.stem not in listed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a page is out of date")
    args = parser.parse_args()
    if missing := unlisted():
        raise SystemExit(f"bench/report.py: BENCHES lacks {', '.join(missing)}")
    pages = {PAGE: page(), README: readme(README.read_text())}
    stale = [p for p, text in pages.items() if not p.exists() or p.read_text() != text]
    if args.check:
        if stale:
            names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
            sys.exit(f"out of date: {names} (run `make bench-report`)")
        return
    for path in stale:
        path.write_text(pages[path])
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
