"""The CI skip guard (tests/helper_skips.py) on a throwaway test folder, through a real pytest
subprocess under xdist, as `make test` runs it: under FORGE_NO_SKIPS=1 a skip without the
`gpu` marker fails the run with one line naming it, and a gpu-marked skip does not."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from helper_skips import NO_GPU

TESTS = Path(__file__).parents[1]

TEST_A = """
import pytest

def test_passes():
    pass

@pytest.mark.gpu
def test_on_gpu():
    pass

def test_skips():
    pytest.skip("no SLURM node is idle")

@pytest.mark.xfail(reason="known bug")
def test_expected_to_fail():
    assert False
"""
# Skipped while collected: no test report, only the module's.
TEST_B = """
import pytest

pytest.importorskip("no_such_module_here")

def test_never_runs():
    pass
"""


def run_pytest(folder: Path, *args: str, no_skips: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "FORGE_NO"))}
    env["PYTHONPATH"] = str(TESTS)
    if no_skips:
        env["FORGE_NO_SKIPS"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-p", "helper_skips", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*cmd, "-rs", *args], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )


def write_tests(folder: Path) -> None:
    (folder / "pytest.ini").write_text("[pytest]\nmarkers = gpu: needs a CUDA GPU\n")
    (folder / "test_a.py").write_text(TEST_A)
    (folder / "test_b.py").write_text(TEST_B)


def test_a_skip_without_the_gpu_marker_fails_the_run_under_xdist(tmp_path):
    write_tests(tmp_path)
    done = run_pytest(tmp_path, "-n", "2", no_skips=True)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("FORGE_NO_SKIPS=1")]
    assert line == (
        "FORGE_NO_SKIPS=1: 2 test(s) skipped without the gpu marker: "
        "test_a.py::test_skips (no SLURM node is idle); test_b.py (could not import "
        "'no_such_module_here': No module named 'no_such_module_here')"
    )
    # Neither the gpu-marked test (skipped or, on a GPU machine, passed) nor the xfail is named.
    assert "1 xfailed" in done.stdout and "1 failed" not in done.stdout


def test_a_gpu_marked_skip_passes_under_xdist(tmp_path):
    write_tests(tmp_path)
    done = run_pytest(tmp_path, "-n", "2", "test_a.py", "-k", "not skips", no_skips=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FORGE_NO_SKIPS" not in done.stdout
    if torch.cuda.is_available():
        assert "2 passed" in done.stdout
    else:  # the marker alone skips it, with the reason
        assert f"SKIPPED [1] test_a.py:7: {NO_GPU}" in done.stdout
        assert "1 passed, 1 skipped" in done.stdout


def test_skips_pass_without_the_guard(tmp_path):
    write_tests(tmp_path)
    done = run_pytest(tmp_path, no_skips=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FORGE_NO_SKIPS" not in done.stdout
