"""Tables of rows read with Hugging Face `datasets`, and the checks every row must pass.

Two ways in, one kind of table out (a `datasets.Dataset`):
    local  a `Dataset.save_to_disk` folder, or one .json / .jsonl / .parquet / .csv file.
    hf     `datasets.load_dataset(path, subset, split=...)`: a dataset name on the Hugging Face
           Hub, or a repository folder of data files (its splits from the file names).

Every failure is a DatasetError whose message is one line naming the path and, where there is
one, the row and the column:
    - a path the loader cannot read names the file and the loader's root cause, or, for a json
      file, the first row that is not valid JSON or not an object;
    - a prompt or answer that is null, empty or of the wrong type names the row and column
      (`malformed_rows`; the dataset decides whether to raise or to skip them).
A row is named as an editor shows it (`row_names`): "line N" in a JSON Lines or csv file, else
"row N", both counting from 1.
"""

import csv
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # `datasets` takes a second or two of CPU to import
    import datasets


class DatasetError(ValueError):
    """A dataset that cannot be built: the message is one line naming the source, row, column."""


FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_table(
    source: Literal["local", "hf"],
    path: str,
    split: str,
    columns: tuple[str, str],
    subset: str | None = None,
    cache_dir: str | None = None,
) -> "datasets.Dataset":
    """The table at `path` (see the module docstring for what each source reads); `columns`
    (prompt, answer) name the row a json file the loader refuses breaks first.

    Raises:
        DatasetError: the path, split or dataset cannot be loaded; one line naming it.
    """
    if source == "hf":
        return _load_hf(path, subset, split, cache_dir)
    folder = Path(path)
    if folder.is_dir():
        return _load_saved(folder, split)
    if not folder.is_file():
        raise DatasetError(f"{path}: no such file or folder")
    if split != "train":
        raise DatasetError(f"{path}: one file holds one split, 'train'; no split {split!r}")
    return _load_file(folder, columns, cache_dir)


def _load_hf(
    path: str, subset: str | None, split: str, cache_dir: str | None
) -> "datasets.Dataset":
    import datasets

    try:
        return datasets.load_dataset(path, subset, split=split, cache_dir=cache_dir)
    except ValueError as e:
        if "Unknown split" in str(e) or "Bad split" in str(e):
            raise DatasetError(f"hf dataset {path}: no split {split!r}: {_first_line(e)}") from e
        raise DatasetError(f"hf dataset {path}: cannot load: {_first_line(e)}") from e
    except Exception as e:  # not found, no network, a bad repository: the loader's own reason
        raise DatasetError(
            f"hf dataset {path}: cannot load: {type(e).__name__}: {_first_line(e)}"
        ) from e


def _load_saved(folder: Path, split: str) -> "datasets.Dataset":
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except FileNotFoundError as e:
        raise DatasetError(
            f"{folder}: not a save_to_disk folder ({_first_line(e)}); a folder of data files "
            "is read with data.source: hf"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{folder}: no split {split!r} (splits: {', '.join(loaded)})")
        return loaded[split]
    if split != "train":
        raise DatasetError(f"{folder}: holds one dataset, not splits; no split {split!r}")
    return loaded


def _load_file(path: Path, columns: tuple[str, str], cache_dir: str | None) -> "datasets.Dataset":
    import datasets

    builder = FILE_BUILDERS.get(path.suffix)
    if builder is None:
        raise DatasetError(f"{path}: unknown file type; use {', '.join(FILE_BUILDERS)}")
    load = functools.partial(
        datasets.load_dataset, builder, data_files=str(path), split="train", cache_dir=cache_dir
    )
    try:
        if builder != "json":
            return load()
        try:
            return load()
        except Exception:
            # datasets 4.7's json loader reads a key absent from some rows only with its
            # mixed-type detection off (on, it raises KeyError), and mixed types only with it on.
            return load(on_mixed_types=None)
    except Exception as e:
        # The loaders fail in many ways (KeyError, pyarrow errors): read a json file ourselves
        # to name the bad row, else report the root cause (pyarrow's names column and row).
        problem = _json_problem(path, columns) if builder == "json" else None
        while e.__cause__ is not None:
            e = e.__cause__
        raise DatasetError(problem or f"{path}: cannot load: {type(e).__name__}: {e}") from e


def _json_problem(path: Path, columns: tuple[str, str]) -> str | None:
    """The first malformed row of a json/jsonl file, if any (see `row_problem`)."""
    text = path.read_text(encoding="utf-8")
    numbered = _json_lines(text)
    if numbered is None:
        document = json.loads(text)
        records = document if isinstance(document, list) else [document]
        places = [f"row {index + 1}" for index in range(len(records))]
    else:
        records, places = [], []
        for number, line in numbered:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                return f"{path} line {number}: not valid JSON: {e.msg}"
            places.append(f"line {number}")
    for record, place in zip(records, places, strict=True):
        if not isinstance(record, dict):
            return f"{path} {place}: a {type(record).__name__}, not a JSON object"
        problem = row_problem(record, columns)
        if problem:
            return f"{path} {place}: {problem}"
    return None


def _json_lines(text: str) -> list[tuple[int, str]] | None:
    """A JSON Lines text's non-blank lines with their numbers (from 1), or None for a text
    that is one JSON document (an array of rows, or one object)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        # Split on newlines only, as editors number lines: a JSON string may hold U+2028.
        return [(n, line) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
    return None


def row_names(path: Path | None, rows: int) -> Callable[[int], str]:
    """How messages name row `index` of a table of `rows` rows read from `path` (None: not a
    file): "line N" where the file holds one row per line (JSON Lines) or per record (csv,
    whose header is line 1), else "row N"; both count from 1, as an editor numbers lines."""
    lines = _row_lines(path) if path is not None and path.is_file() else None
    if lines is not None and len(lines) == rows:
        return lambda index: f"line {lines[index]}"
    return lambda index: f"row {index + 1}"


def _row_lines(path: Path) -> list[int] | None:
    """The line each row of a JSON Lines or csv file starts on, or None for other files."""
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            next(reader, None)  # the header
            starts, end = [], reader.line_num
            for record in reader:
                if record:  # the loader (pandas) skips blank lines
                    starts.append(end + 1)
                end = reader.line_num  # a quoted field may span lines
            return starts
    if path.suffix in (".json", ".jsonl"):
        numbered = _json_lines(path.read_text(encoding="utf-8"))
        return None if numbered is None else [number for number, _ in numbered]
    return None


def require_columns(where: str, columns: Sequence[str], column: str, key: str) -> None:
    """Raises DatasetError unless `column` is among `columns` (of the source `where`); the
    message names the columns there are and the config `key` that names the column."""
    if column not in columns:
        raise DatasetError(
            f"{where}: no column {column!r} (columns: {', '.join(columns)}); set {key}"
        )


def malformed_rows(
    table: "datasets.Dataset",
    name: str,
    columns: tuple[str, str],
    limit: int | None = None,
    path: Path | None = None,
) -> dict[int, str]:
    """Row index -> "<name> <row>: column '<column>' <problem>", for each malformed row of
    the first `limit` rows (None: all); `<row>` is "line N" or "row N" (`row_names`, for the
    file at `path` the table was read from, if any). `columns`: the prompt and answer columns."""
    rows = table.select_columns(list(columns))
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    problems = {}
    for index, record in enumerate(rows):
        problem = row_problem(record, columns)
        if problem:
            problems[index] = problem
    if not problems:
        return {}
    named = row_names(path, len(table))
    return {index: f"{name} {named(index)}: {problem}" for index, problem in problems.items()}


def row_problem(record: dict[str, Any], columns: tuple[str, str]) -> str | None:
    """What is wrong with a row's prompt or answer ("column 'q' is null"), or None."""
    for column, check in zip(columns, (_prompt_problem, _answer_problem), strict=True):
        if column not in record:
            return f"no column {column!r}"
        problem = check(record[column])
        if problem:
            return f"column {column!r} {problem}"
    return None


def _prompt_problem(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None if prompt.strip() else "is an empty string"
    if isinstance(prompt, list) and prompt:
        chat = all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        )
        return None if chat else "is a list but not chat messages ({role, content} strings)"
    return _type_problem(prompt, "a string or chat messages")


def _answer_problem(answer: Any) -> str | None:
    if isinstance(answer, str):
        return None if answer.strip() else "is an empty string"
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        return None
    return _type_problem(answer, "a string or a number")


def _type_problem(value: Any, expected: str) -> str:
    if value is None:
        return "is null"
    return f"is a {type(value).__name__} ({str(value)[:40]!r}), expected {expected}"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [repr(e)])[0]
