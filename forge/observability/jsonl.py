"""Reading the run's logs of one JSON object a line (metrics.jsonl, timeline.jsonl,
startup.jsonl), which a running run may be appending to."""

import json
from pathlib import Path


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of `path` in the order they were written; none if it does not exist. A last
    line still being written (no newline yet) is left out."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [json.loads(line) for line in lines if line.strip()]
