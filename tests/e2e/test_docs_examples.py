"""Every Python example in the README and docs/ runs as written: scripts with `python`, the app
example with the `forge run` command the page gives for it."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helper_runs import ROOT

pytestmark = pytest.mark.integration

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```(python|sh)\n(.*?)```", re.S)


def blocks(page: Path) -> list[tuple[str, str]]:
    return BLOCK.findall(page.read_text())


EXAMPLES = [
    pytest.param(page, code, id=f"{page.name}-{i}")
    for page in PAGES
    for i, (lang, code) in enumerate(blocks(page))
    if lang == "python"
]


def test_every_python_example_is_complete():
    """A script (ends in asyncio.run) or an app (defines main(cfg)): nothing left to fill in."""
    assert EXAMPLES
    for param in EXAMPLES:
        page, code = param.values
        assert "asyncio.run(main())" in code or "def main(cfg" in code, page
        assert "..." not in code, page


@pytest.mark.parametrize(("page", "code"), EXAMPLES)
def test_example_runs_as_written(page, code, tmp_path):
    if "def main(cfg" in code:
        _run_app(page, code, tmp_path)
        return
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "the example prints what it shows"


def _run_app(page: Path, code: str, tmp_path: Path) -> None:
    """The app's file is the path the page names in `# <path>`; the command is the page's."""
    path = code.splitlines()[0].removeprefix("# ").strip()
    command = next(c for lang, c in blocks(page) if lang == "sh" and path in c).strip()
    app = tmp_path / path
    app.parent.mkdir(parents=True)
    app.write_text(code)
    argv = shlex.split(command.replace(path, str(app)))
    assert argv[:2] == ["forge", "run"], command
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "forge", *argv[1:], f"run_dir={run_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = run_dir / "forge.log"
    assert out.returncode == 0, (log.read_text() if log.exists() else out.stderr)[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
