"""GPU-only tests, and no silent skips in CI (a pytest plugin that tests/conftest.py loads).

A test marked `gpu` is skipped, with the reason, where torch sees no CUDA GPU. With
FORGE_NO_SKIPS=1 in the environment (`.ci/run` sets it), any other skip (a test, or a whole
module at collection) fails the session with one line naming each skipped test and its reason:
a SLURM cluster that did not come up, or a backend that stopped importing, must not pass CI as
"skipped".

Works under pytest-xdist: reports of skipped tests and collections reach the controller's
hooks, which decide; the workers do nothing here.
"""

import os

import pytest

NO_GPU = "no CUDA GPU here (torch.cuda.is_available() is False)"


def pytest_configure(config: pytest.Config) -> None:
    # Under xdist only the controller sees every worker's reports, so only it decides.
    if os.environ.get("FORGE_NO_SKIPS") == "1" and not hasattr(config, "workerinput"):
        config.pluginmanager.register(SkipGuard(), "forge-skip-guard")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return  # torch is imported only when a GPU test was collected
    import torch

    if not torch.cuda.is_available():
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason=NO_GPU))


class SkipGuard:
    """Fails the session if a test or module without the `gpu` marker was skipped."""

    def __init__(self) -> None:
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        # An xfail is reported as skipped but ran; a gpu-marked test may skip where none is.
        # A collection report has no keywords: a module skipped while collected always counts.
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        if "gpu" in getattr(report, "keywords", {}):
            return
        if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: <reason>")
            reason = report.longrepr[2].removeprefix("Skipped: ")
        else:
            reason = str(report.longrepr)
        self.skipped.append(f"{report.nodeid} ({reason})")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.skipped and session.exitstatus == pytest.ExitCode.OK:
            # Read as the run's exit status after this hook: pytest exits 1.
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.skipped:
            terminalreporter.write_line(self.message(), red=True, bold=True)

    def message(self) -> str:
        return (
            f"FORGE_NO_SKIPS=1: {len(self.skipped)} test(s) skipped without the gpu marker: "
            + "; ".join(sorted(self.skipped))  # xdist workers report in any order
        )
