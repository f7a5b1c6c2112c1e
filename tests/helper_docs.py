"""The fenced code blocks of README.md and docs/*.md, and what the tests do with each.

A block of commands or code (```sh, ```python) sits right under a marker line (docs/testing.md,
"Docs that run"):

    <!-- doc-test: run -->                  tests/e2e/test_docs_examples.py runs it as written
    <!-- doc-test: skip (why not) -->       not run, for the reason given

Every other block is not a command and carries no marker: ```text (output, a usage line, a
signature) or ```yaml (a config excerpt). tests/unit/test_docs.py holds every page to this.
"""

import re
from dataclasses import dataclass
from pathlib import Path

from helper_runs import ROOT

PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
# Blocks that are commands or code, each marked; blocks that are neither, never marked.
COMMANDS = ("sh", "python")
NOT_COMMANDS = ("text", "yaml")
MARKER = re.compile(r"<!-- doc-test: (?:(?P<run>run)|skip \((?P<reason>.+)\)) -->")
FENCE = "```"


@dataclass(frozen=True)
class Block:
    """One fenced block of a page.

    Args:
        page: the markdown file.
        line: the line of its opening fence, from 1.
        lang: the fence's language ("" for none).
        code: its text, without the fences.
        marker: the line above the opening fence.
    """

    page: Path
    line: int
    lang: str
    code: str
    marker: str

    @property
    def name(self) -> str:
        """`page:line`, the block's test id."""
        return f"{self.page.name}:{self.line}"

    @property
    def runs(self) -> bool:
        """Marked `<!-- doc-test: run -->`."""
        match = MARKER.fullmatch(self.marker.strip())
        return match is not None and match["run"] is not None

    @property
    def skip_reason(self) -> str | None:
        """The reason of a `<!-- doc-test: skip (reason) -->` marker, else None."""
        match = MARKER.fullmatch(self.marker.strip())
        reason = match["reason"] if match else None
        return reason.strip() or None if reason else None

    @property
    def app_path(self) -> str | None:
        """An app's file, named by its first line (`# apps/short/main.py`), for a python block
        that defines `main(cfg)`; None for a script or another block."""
        first = self.code.partition("\n")[0]
        if self.lang != "python" or "def main(cfg" not in self.code or not first.startswith("# "):
            return None
        return first.removeprefix("# ").strip()


def blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, in order.

    Raises:
        ValueError: a block is never closed.
    """
    lines = page.read_text().splitlines()
    found: list[Block] = []
    start = None
    for number, line in enumerate(lines, start=1):
        if not line.startswith(FENCE):
            continue
        if start is None:
            start = number
            continue
        code = "".join(text + "\n" for text in lines[start : number - 1])
        marker = lines[start - 2] if start > 1 else ""
        found.append(Block(page, start, lines[start - 1][len(FENCE) :].strip(), code, marker))
        start = None
    if start is not None:
        raise ValueError(f"{page.name}:{start}: a code block that is never closed")
    return found
