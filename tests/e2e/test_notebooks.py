"""The notebooks under notebooks/ run top to bottom in a real Jupyter kernel (this venv's
Python) started where Jupyter starts it, in the notebook's folder; their cells show no library
log lines, whether the notebook chose the log file or (02, a Generator service) left it to forge
(06 attaches to a `forge run` it starts, whose library lines go to its run's forge.log);
they leave no process behind and survive an interrupted cell."""

import json
import re
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from helper_runs import ROOT
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

pytestmark = pytest.mark.integration

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FIRST = ROOT / "notebooks" / "01_actors_and_services.ipynb"
# What vLLM, Monarch, torch, Python's warnings and libraries' loggers (math-verify's timeout
# notice) print; a notebook sends it to its log file.
LIBRARY_LINE = re.compile(
    r"WARNING|INFO|Warning|it/s\]|Monarch internal logs|Triton|\(EngineCore|\(MainProcess"
    r"|Timeout is disabled"
)
# The line that names the library log: the first a notebook shows.
LOG_LINE = re.compile(r"^library output \(vLLM, Monarch, torch\) -> (.+)$")
# A cell (found by a piece of its code) whose output is exactly these lines after the log's.
EXACT_OUTPUT = {
    "02_generator_and_weights": ("as_service(cfg, sync)", ["serving version 0"]),
}
# Notebooks that leave the log to forge: the kernel's own, under its working folder.
DEFAULT_LOG = {"02_generator_and_weights"}
# Notebooks whose libraries run in a `forge run` they start: its forge.log holds their lines.
RUN_LOG = {"06_live_run": ROOT / "runs" / "notebook-06"}
# What the tests run a notebook on, where it runs something larger by hand.
TINY = {"FORGE_NOTEBOOK_CONFIG": "configs/grpo/tiny_cpu.yaml"}
TINY_MODEL = {"FORGE_NOTEBOOK_MODEL": "tiny-llama"}
ENVIRONMENT = {
    "02_generator_and_weights": TINY_MODEL,
    "03_grpo_step_by_step": TINY,
    "04_distillation": {"FORGE_NOTEBOOK_CONFIG": "configs/distillation/tiny_cpu.yaml"},
    "05_environments": TINY_MODEL,
    "06_live_run": TINY,
}


def test_notebooks_are_committed_without_outputs():
    assert NOTEBOOKS
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        code = [c for c in cells if c["cell_type"] == "code"]
        assert all(not c["outputs"] and c["execution_count"] is None for c in code), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    for key, value in ENVIRONMENT.get(path.stem, {}).items():
        monkeypatch.setenv(key, value)  # the kernel inherits it
    nb = nbformat.read(path, as_version=4)
    log = ROOT / "runs" / "notebooks" / f"{path.stem}.log"
    log.unlink(missing_ok=True)
    # As Jupyter runs it: the kernel's working directory is the notebook's folder.
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources=_in(path.parent))
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the cell that failed
    print(f"{path.name}: {time.perf_counter() - start:.0f} s")
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors
    shown = [line for c in nb.cells for line in _printed(c)]
    assert not [line for line in shown if LIBRARY_LINE.search(line)], shown
    named = LOG_LINE.match(shown[0])
    assert named, shown[:3]
    shown_log = Path(named[1])
    if path.stem in DEFAULT_LOG:  # the kernel's own, under its working folder
        assert shown_log.parent == (path.parent / "runs" / "notebooks").resolve(), shown_log
        assert shown_log.name.startswith("kernel-") and not log.exists()
    else:
        assert shown_log == log.resolve()
    text = shown_log.read_text()
    if path.stem in DEFAULT_LOG:
        shown_log.unlink()
    if path.stem in RUN_LOG:
        newest = max(p for p in RUN_LOG[path.stem].iterdir() if p.is_dir())
        text = (newest / "forge.log").read_text()
    assert LIBRARY_LINE.search(text), "the library lines went to no log"
    if path.stem in EXACT_OUTPUT:
        piece, lines = EXACT_OUTPUT[path.stem]
        (cell,) = [c for c in nb.cells if c.cell_type == "code" and piece in c.source]
        assert _printed(cell)[1 if path.stem in DEFAULT_LOG else 0 :] == lines


def _printed(cell) -> list[str]:
    """The lines a code cell printed (its stream outputs)."""
    streams = [o["text"] for o in cell.get("outputs", []) if o["output_type"] == "stream"]
    return "".join(streams).splitlines()


def _in(folder: Path) -> dict:
    return {"metadata": {"path": str(folder)}}


def _code_cells(path: Path) -> list[str]:
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def _run(client, code: str, timeout: float = 300) -> dict:
    reply = client.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
    assert reply["content"]["status"] == "ok", reply["content"]
    return reply


@pytest.fixture
def kernel():
    """A kernel started where Jupyter starts it; its descendants are checked by the tests."""
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(FIRST.parent))
    yield manager, client
    client.stop_channels()
    if manager.is_alive():
        manager.shutdown_kernel(now=True)


def test_an_interrupted_cell_leaves_the_service_usable_and_the_kernels_end_leaves_no_process(
    kernel,
):
    manager, client = kernel
    cells = _code_cells(FIRST)
    for code in cells[:4]:  # the log file, the actor class, one actor, a 2-replica service
        _run(client, code)
    kernel_pid = manager.provisioner.process.pid
    # stop_on_error=False: after an error the kernel aborts execute requests that reach it
    # before it has flushed its queue, a race with the next cell this test sends at once.
    long_cell = client.execute(
        "while True:\n    await workers.work.route(1, seconds=0.2)\n    print('.', end='')",
        stop_on_error=False,
    )
    _wait_for_calls(client, long_cell, 3)  # calls run: the interrupt lands mid-call
    manager.interrupt_kernel()
    reply = client.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == long_cell
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] in ("KeyboardInterrupt", "CancelledError")
    _run(client, "assert (await workers.work.route(3))[1] == 9")
    children = psutil.Process(kernel_pid).children(recursive=True)
    _run(client, "await shutdown()")
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [p.cmdline() for p in alive]

    # Started again, then the kernel shut down with the service (and a replaced one) running.
    for code in cells[2:4]:
        _run(client, code)
    _run(client, cells[3])  # run again: replaces the service instead of adding one
    children = psutil.Process(kernel_pid).children(recursive=True)
    assert len(children) >= 3, children
    manager.shutdown_kernel(now=False)
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [p.cmdline() for p in alive]


def _wait_for_calls(client, cell: str, calls: int) -> None:
    """Reads the kernel's output until `cell` has printed a dot for each of `calls` calls."""
    done = 0
    while done < calls:
        msg = client.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == cell and msg["msg_type"] == "stream":
            done += msg["content"]["text"].count(".")
