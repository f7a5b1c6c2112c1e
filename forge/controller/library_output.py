"""Where what libraries print goes in a Jupyter kernel: a log file, not the cells.

`forge run` sends vLLM's, Monarch's and torch's lines to the run folder's forge.log and shows
forge's own on the console. A kernel gets the same by default: the first proc mesh started in it
sends the libraries' output to runs/notebooks/kernel-<pid>.log (under the kernel's working
folder) and names that file in the cell's output, unless `library_output_to` already chose one.
"""

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import TextIO

_log: TextIO | None = None
_log_handler: logging.Handler | None = None


def library_output_to(log: str | Path) -> Path:
    """Sends what libraries print to `log` (appended) instead of the notebook's cells, and
    returns its absolute path.

    Libraries print in two ways. The actors' processes inherit this kernel's file descriptors
    1 and 2, and Monarch writes the output it forwards from them there too: ipykernel copies
    both into the running cell, so they are pointed at the log. In this process, Python
    warnings and the records of Python's logging go to the log as well (without a handler of
    its own, logging prints warnings to the cell: math-verify's, for one). `print` in the
    kernel (forge's lines, the notebook's own) keeps the cell: ipykernel's `sys.stdout` does
    not write to descriptor 1. What an actor prints goes to the log, with the libraries' lines
    of its process.
    """
    global _log
    log = Path(log).resolve()
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if _log is not None:
        _log.close()
    _log = open(log, "a", buffering=1)  # noqa: SIM115 -- open for the kernel's lifetime
    warnings.showwarning = _warning_to_log
    global _log_handler
    root = logging.getLogger()
    if _log_handler is not None:
        root.removeHandler(_log_handler)
    _log_handler = logging.StreamHandler(_log)
    root.addHandler(_log_handler)
    print(f"library output (vLLM, Monarch, torch) -> {log}")
    return log


def _warning_to_log(message, category, filename, lineno, file=None, line=None) -> None:
    _log.write(warnings.formatwarning(message, category, filename, lineno, line))


def library_output_by_default() -> Path | None:
    """In a Jupyter kernel whose library output still goes to its cells, sends it to
    runs/notebooks/kernel-<pid>.log; returns that file (None: not a kernel, or already sent)."""
    if _log is not None or not _in_kernel():
        return None
    try:
        return library_output_to(Path("runs") / "notebooks" / f"kernel-{os.getpid()}.log")
    except OSError:  # a folder the kernel cannot write to: the cells keep the output
        return None


def _in_kernel() -> bool:
    """Whether this process is an IPython kernel (a notebook's, or a console's)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None
