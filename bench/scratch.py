"""Where a bench's runs write their folders: one temporary folder per bench, removed when it exits.

A bench's runs write checkpoints and exports, gigabytes on a SmolLM2 config; a bench reads the
figures it needs from them as it goes, so nothing in them is wanted afterwards. The library log
(`library_log.py`) is kept: it is what to read when a bench fails.
"""

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_folder(name: str) -> Path:
    """A new folder for `name`'s run folders and caches, removed with its contents when the
    bench's process exits (finished, failed or interrupted by Ctrl-C)."""
    folder = Path(tempfile.mkdtemp(prefix=f"forge-bench-{name}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
