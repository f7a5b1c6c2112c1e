"""User code named by a "module:attribute" path in a config (a reward function, an
environment factory), imported with one-line errors; a module of its own so that every layer
can use it."""

import importlib
from collections.abc import Callable
from typing import Any


def import_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable `spec` ("module:attribute") names; `what` names it in errors.

    Raises:
        ValueError: `spec` is not "module:attribute", does not import, or is not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(f"{what} {spec!r}: name it as module:attribute")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as e:
        hint = f" (is the folder holding {e.name} on PYTHONPATH?)" if e.name == module_name else ""
        raise ValueError(f"cannot import {what} {spec!r}: {e}{hint}") from e
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {what} {spec!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"{what} {spec!r} is a {type(fn).__name__}, not callable")
    return fn
