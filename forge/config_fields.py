"""The settings of a loaded config: each leaf field of its dataclasses, with its value, its
default and its meaning (what `forge config show` prints).

A field's meaning is its entry in the `Args:` or `Attributes:` section of the docstring of the
dataclass that declares it, or of a base class: the one place config fields are documented.
An entry may name several fields (`mis_low, mis_high: ...`); its continuation lines are indented
deeper than its first.
"""

import dataclasses
import difflib
import functools
import inspect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from forge.config import ConfigError

_SECTIONS = ("Args:", "Attributes:")
_ENTRY = re.compile(r"(\w+(?:, \w+)*): (.*)")


@dataclass(frozen=True)
class Setting:
    """One leaf field of a config.

    Args:
        key: its dotted key, as overrides spell it (`trainer.optimizer.lr`).
        value: its value in the config.
        default: its dataclass default; dataclasses.MISSING where the field has none.
        meaning: its docstring entry, on one line; "" where no docstring documents it.
    """

    key: str
    value: Any
    default: Any
    meaning: str

    def line(self) -> str:
        """`key = value  (default: value)  # meaning`, the values as JSON (which yaml reads);
        no `# meaning` where there is none."""
        default = "required" if self.default is dataclasses.MISSING else _show(self.default)
        shown = f"{self.key} = {_show(self.value)}  (default: {default})"
        return f"{shown}  # {self.meaning}" if self.meaning else shown


def settings(cfg: Any, under: str | None = None) -> list[Setting]:
    """Every leaf field of the config dataclass `cfg`, depth first in field order, or only
    those `under` a dotted key: a setting's, or a section's. A field holding a dataclass is a
    section, walked rather than shown; one that is None is a leaf.

    Raises:
        ConfigError: `under` is neither a setting nor a section; it names the closest key.
    """
    every = list(_walk(cfg, None, ""))
    if under is None:
        return every
    chosen = [s for s in every if s.key == under or s.key.startswith(f"{under}.")]
    if not chosen:
        parts = [s.key.split(".") for s in every]
        keys = {".".join(p[:i]) for p in parts for i in range(1, len(p) + 1)}
        close = difflib.get_close_matches(under, sorted(keys), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"--key {under}: no such setting or section{hint}")
    return chosen


def _walk(node: Any, defaults: Any, prefix: str) -> Iterator[Setting]:
    """The leaves of dataclass `node`; `defaults`: the default of `node` itself, whose fields
    are its fields' defaults (None: take each field's own)."""
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        default = _field_default(f) if defaults is None else getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            # A section whose default is None (eval.data): its fields' own defaults.
            yield from _walk(value, default if type(default) is type(value) else None, f"{key}.")
        else:
            yield Setting(key, value, default, meaning(type(node), f.name))


def _field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def meaning(cls: type, name: str) -> str:
    """The docstring entry of field `name` of dataclass `cls`, from `cls` or the nearest base
    class that documents it, on one line; "" if none does."""
    for klass in cls.__mro__:
        if found := _documented(klass).get(name):
            return found
    return ""


@functools.cache
def _documented(cls: type) -> dict[str, str]:
    """Field name -> its entry, on one line, in the Args: or Attributes: sections of the
    docstring `cls` itself has (not one it inherits)."""
    entries: dict[str, list[str]] = {}
    section = entry = None  # the depths of the section's header and of its entries
    names: list[str] = []  # the fields the entry being read documents
    for line in inspect.cleandoc(cls.__dict__.get("__doc__") or "").splitlines():
        depth, text = len(line) - len(line.lstrip()), line.strip()
        if section is not None and text and depth <= section:
            section = None  # back at the header's depth: the section has ended
        if text in _SECTIONS:
            section, entry, names = depth, None, []
        elif section is not None and text:
            entry = depth if entry is None else entry
            match = _ENTRY.fullmatch(text) if depth == entry else None
            if match:
                names = match[1].split(", ")
            for name in names:
                entries.setdefault(name, []).append(match[2] if match else text)
    return {name: " ".join(lines) for name, lines in entries.items()}


def _show(value: Any) -> str:
    # An Enum choice (forge.config allows them) as the value a yaml file gives.
    return json.dumps(value, default=lambda choice: choice.value)
