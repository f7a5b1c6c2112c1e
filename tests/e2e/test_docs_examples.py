"""Every block of README.md and docs/*.md marked `<!-- doc-test: run -->` runs as written
(tests/helper_docs.py; tests/unit/test_docs.py holds every other block to a stated reason):
```sh blocks with bash, stopping at the first command that fails; ```python scripts with
`python`; an app (a python block whose first line names its file) through the command of its
page that runs it.

They run in one folder that a command takes for the checkout: the checkout's files, linked,
but a `runs/` of its own, `apps/` with the pages' apps written beside the shipped ones, and
`.venv` the venv these tests run in, its `bin` first on PATH, as an activated venv puts it. So
the commands need no rewriting, and pages that repeat a run command share its one run: the
first runs it, the others find it finished.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helper_docs import PAGES, Block, blocks
from helper_runs import ROOT

pytestmark = pytest.mark.integration

RUNNABLE = [b for page in PAGES for b in blocks(page) if b.runs and b.app_path is None]
# Not in the checkout's folder: the run folders the commands write, the apps the pages write.
OWN = ("runs", "apps", ".venv")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("checkout")
    for entry in ROOT.iterdir():
        if entry.name not in OWN:
            (folder / entry.name).symlink_to(entry)
    (folder / "apps").mkdir()
    for app in (ROOT / "apps").iterdir():
        (folder / "apps" / app.name).symlink_to(app)
    (folder / ".venv").symlink_to(sys.prefix)
    return folder


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda block: block.name)
def test_block_runs_as_written(block: Block, checkout: Path, tmp_path: Path) -> None:
    if block.lang == "sh":
        for app in blocks(block.page):
            if app.runs and app.app_path is not None:
                (checkout / app.app_path).parent.mkdir(parents=True, exist_ok=True)
                (checkout / app.app_path).write_text(app.code)
        command = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    else:
        script = tmp_path / "example.py"
        script.write_text(block.code)
        command = [sys.executable, str(script)]
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": os.pathsep.join([venv_bin, os.environ["PATH"]])}
    out = subprocess.run(
        command, cwd=checkout, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, _failure(out, checkout)
    assert out.stdout.strip(), "it prints what the page shows"


def _failure(out: subprocess.CompletedProcess, checkout: Path) -> str:
    """The command's output, and the end of each run's log: where a failed run says why."""
    logs = [f"--- {log}\n{log.read_text()[-2000:]}" for log in checkout.glob("runs/*/forge.log")]
    return "\n".join([out.stdout[-2000:], out.stderr[-3000:], *logs])
