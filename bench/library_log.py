"""The benches' console: their own lines on the terminal, every library's output in a log file.

A bench runs forge's apps and engines in its own process, so vLLM's, Monarch's and torch's
warnings would fill the terminal between the figures; `forge run` sends them to the run's
forge.log, and a bench sends them to a log of its own.
"""

import tempfile
from pathlib import Path

from forge.observability.console import capture_to, say


def library_output_to_log(bench: str) -> Path:
    """Captures stdout and stderr (this process's and its children's) into a fresh log file,
    says where on the terminal, and returns its path; print the figures with `say`."""
    log = Path(tempfile.mkdtemp(prefix=f"forge-bench-{bench}-log-")) / "library.log"
    capture_to(log)
    say(f"{bench}: library output -> {log}")
    return log
