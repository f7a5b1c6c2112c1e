"""Configs: yaml files and command-line overrides loaded onto dataclasses, with one-line errors.

A config is a dataclass (holding other dataclasses, lists, dicts, Optional values, and choices
as an Enum or a Literal); a yaml file maps onto it one to one. `load_config` applies, in order,
the dataclass defaults, the yaml file and `key=value` overrides with dotted keys
(`trainer.optimizer.lr=1e-4`, values parsed as yaml), resolves `${...}` interpolations and
returns an instance of the dataclass.

A dataclass checks its own values in `__post_init__`: a field's range with `require`,
`at_least` or `positive`, which raise FieldError (the error names the field's full key), a
combination of fields with a ValueError (the error names the section). What must exist on the
machine that runs (a model, an environment factory) is checked by the dataclass's
`check_available()` method, which `load_config(..., available=True)` calls on every section:
`forge run` asks for it, `forge config show` and `forge plan` (which may look at another
machine's config) do not. YAML 1.1 reads `on`, `off`, `yes`, `no`, `y` and `n` as booleans: one
given to a `Literal` or Enum field that holds the word is taken as the word
(`trainer.guard.action: off`).

A dataclass whose key was renamed or removed says so in a class attribute
`RENAMED_KEYS: ClassVar[dict[str, str]]` (old key -> where it went), and the error quotes it.
A key there that is still a field is one the config derives (its `__post_init__`, or the app,
fills it in): no input sets it, but a run folder's saved config (`known_only`) holds it.

Every bad input raises ConfigError, whose message is one line naming where the input came from
(the yaml file, or "command line") and the full dotted key:

    run.yaml: trainer.optimizer.lr: Value 'fast' of type 'str' could not be converted to Float
    command line: trainer.optimizer.lr: must be > 0, got -1.0
"""

import contextlib
import dataclasses
import difflib
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from pathlib import Path
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf._yaml import get_yaml_loader
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

T = TypeVar("T")

COMMAND_LINE = "command line"
# The words YAML 1.1 reads as True and as False (lower case): a choice spelled so comes back
# from the yaml parser as a bool.
_YAML_BOOLEANS = {True: ("y", "yes", "true", "on"), False: ("n", "no", "false", "off")}


class ConfigError(ValueError):
    """A bad config input. The message is one line: source, dotted key, what is wrong."""

    def __init__(self, message: str) -> None:
        # Printed as one line by the CLI, whatever a wrapped message (from __post_init__) held.
        super().__init__(" ".join(message.splitlines()))


class FieldError(ValueError):
    """A value one field of a config dataclass refuses, raised by its `__post_init__` or
    `check_available`: the loader's message names the field's full dotted key,
    `command line: trainer.optimizer.lr: must be > 0, got -1.0`.

    Args:
        field: the field's name, or a dotted key inside it (`sampling.max_tokens`).
        detail: what is wrong with its value.
    """

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field, self.detail = field, detail


def require(cfg: object, name: str, ok: Callable[[Any], bool], want: str) -> None:
    """Raises FieldError("`name` must be `want`") unless `ok` holds for that field of `cfg`;
    None (an optional field left unset) passes."""
    value = getattr(cfg, name)
    if value is not None and not ok(value):
        raise FieldError(name, f"must be {want}, got {value!r}")


def at_least(cfg: object, low: int, *names: str) -> None:
    """Raises FieldError for the first field of `names` of `cfg` below `low` (None passes)."""
    for name in names:
        require(cfg, name, lambda v: v >= low, f">= {low}")


def positive(cfg: object, *names: str) -> None:
    """Raises FieldError for the first field of `names` of `cfg` not > 0 (None passes)."""
    for name in names:
        require(cfg, name, lambda v: v > 0, "> 0")


@contextlib.contextmanager
def field_error(name: str) -> Iterator[None]:
    """A ValueError raised inside (a check another module makes) becomes a FieldError of the
    field `name`."""
    try:
        yield
    except FieldError:
        raise
    except ValueError as e:
        raise FieldError(name, str(e)) from None


def check_available(cfg: Any) -> None:
    """Runs the `check_available()` of every config dataclass in `cfg` (a model that resolves
    here, an environment factory that imports and takes its options).

    Raises:
        ConfigError: naming the dotted key of the value that is not available.
    """
    if (refused := _unavailable(cfg)) is not None:
        raise _error("", *refused)


def load_config(
    schema: type[T],
    path: str | Path | None,
    overrides: Sequence[str] = (),
    known_only: bool = False,
    available: bool = False,
) -> T:
    """Build a `schema` instance from its defaults, the yaml file at `path`, then `overrides`.

    Args:
        schema: the config dataclass.
        path: a yaml file whose top level is a mapping onto `schema`, or None for defaults.
        overrides: `dotted.key=value` strings, applied in order after the file.
        known_only: the file is a run folder's config.yaml, an app's config as it ran, read as
            the fields every app shares: only its top-level keys that `schema` has, and the
            values the config derived (RENAMED_KEYS that are fields) taken as saved.
        available: also check that what the config names is available on this machine
            (`check_available`): for a run about to start, not a config only looked at.

    Raises:
        ConfigError: on any bad input, naming its source and key.
    """
    cfg = OmegaConf.structured(schema)
    applied: list[tuple[str, str]] = []  # (dotted key, source) of every value set, in order
    if path is not None:
        data = _read_yaml(Path(path))
        if known_only:
            data = {k: v for k, v in data.items() if k in cfg}
        _merge(cfg, data, str(path), applied, derived=known_only)
    for override in overrides:
        _merge(cfg, _parse_override(override), COMMAND_LINE, applied)
    default_source = COMMAND_LINE if path is None else str(path)
    result = _instantiate(cfg, applied, default_source)
    if available and (refused := _unavailable(result)) is not None:
        key, detail = refused
        raise _error(_sources(key, applied, default_source), key, detail)
    return result


@contextlib.contextmanager
def config_error(key: str) -> Iterator[None]:
    """A ValueError raised inside (bad data found when a run starts, a reward function that
    cannot be imported) becomes a ConfigError naming `key`: one line, exit status 2."""
    try:
        yield
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    """The mapping at the top of the yaml file at `path` ({} for an empty file)."""
    try:
        with path.open(encoding="utf-8") as f:
            # OmegaConf.load's own parser (YAML 1.2 floats like 1e-4, duplicate keys refused),
            # called directly because OmegaConf.load turns a top-level string into a mapping.
            data = yaml.load(f, Loader=get_yaml_loader())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: yaml syntax error: {_yaml_problem(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        got = _shape(data) or type(data).__name__
        raise ConfigError(f"{path}: top level must be a mapping of keys, got {got}")
    return data


def _parse_override(override: str) -> dict[str, Any]:
    """`a.b=[1, 2]` -> {"a": {"b": [1, 2]}}, the value parsed as yaml as in a config file."""
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"{COMMAND_LINE}: {override!r}: expected key=value")
    try:
        value = yaml.load(text, Loader=get_yaml_loader())
    except yaml.YAMLError as e:
        raise ConfigError(
            f"{COMMAND_LINE}: {key}: cannot parse {text!r}: {_yaml_problem(e)}"
        ) from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _merge(
    node: DictConfig,
    data: dict[str, Any],
    source: str,
    applied: list[tuple[str, str]],
    prefix: str = "",
    derived: bool = False,
) -> None:
    """Merge `data` from `source` onto `node` in place, recording in `applied` what it set;
    `derived`: `data` may hold the values the config derives (a run folder's saved config).

    Goes down through mappings one key at a time, so that every error names its full key:
    omegaconf does not, for a mapping given where a list belongs or the reverse.
    """
    children = dict(node.items_ex(resolve=False))
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key in children and not derived and (renamed := _renamed(node, key)):
            raise _error(source, path, renamed)
        expected, got = _shape(children.get(key)), _shape(value)
        if expected and got and expected != got:
            raise _error(source, path, f"expected {expected}, got {got}")
        if expected == got == "a mapping" and _holds_mapping(node, key):
            _merge(node[key], value, source, applied, f"{path}.", derived)
            continue
        try:
            node.merge_with({key: _as_choice(node, key, value)})
        except ConfigKeyError as e:
            raise _error(source, e.full_key or path, _unknown_key(node, key, e)) from None
        except OmegaConfBaseException as e:
            raise _error(source, e.full_key or path, _first_line(e)) from None
        applied.append((path, source))


def _as_choice(node: DictConfig, key: str, value: Any) -> Any:
    """`value`, unless it is a bool that YAML 1.1 read from a word (`off`) given to a Literal
    or Enum field: then the one choice of the field spelled as a word of that truth."""
    if not isinstance(value, bool):
        return value
    schema = OmegaConf.get_type(node)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return value
    choices = _choices(get_type_hints(schema).get(key))
    words = [c for c in choices if isinstance(c, str) and c.lower() in _YAML_BOOLEANS[value]]
    if any(c is value for c in choices) or len(words) != 1:  # a bool choice, or two words
        return value
    return words[0]


def _choices(annotation: Any) -> list[Any]:
    """The values a Literal allows and the member names of an Enum, in an Optional too."""
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return list(annotation.__members__)
    origin = get_origin(annotation)
    if origin is Literal:
        return list(get_args(annotation))
    if origin in (Union, UnionType):
        return [choice for arg in get_args(annotation) for choice in _choices(arg)]
    return []


def _holds_mapping(node: DictConfig, key: str) -> bool:
    """Whether `node[key]` is a mapping to merge into, not None, ??? or an interpolation."""
    if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
        return False
    return isinstance(node.get(key), DictConfig)


def _instantiate(cfg: DictConfig, applied: list[tuple[str, str]], default_source: str) -> Any:
    """Resolve interpolations and build the dataclasses, running their __post_init__ checks."""
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        key, detail = e.full_key or "", "missing required value"
    except OmegaConfBaseException as e:  # an interpolation that does not resolve
        key, detail = e.full_key or "", _first_line(e)
    except FieldError as e:  # a __post_init__ refused one field's value
        key, detail = _join(_refusing_node(cfg), e.field), e.detail
    except ValueError as e:  # a __post_init__ refused a combination of values
        key, detail = _refusing_node(cfg), str(e)
    # Raised outside the handlers so that omegaconf's exception is not chained onto it.
    raise _error(_sources(key, applied, default_source), key, detail)


def _refusing_node(node: DictConfig, prefix: str = "") -> str:
    """Dotted key of the deepest mapping under `node` that fails to instantiate ("" for node)."""
    for key, child in node.items_ex(resolve=False):
        if isinstance(child, DictConfig):
            try:
                OmegaConf.to_object(child)
            except ValueError:
                return _refusing_node(child, f"{prefix}{key}.")
    return prefix.removesuffix(".")


def _unavailable(cfg: Any, prefix: str = "") -> tuple[str, str] | None:
    """(dotted key, why) of the first value in `cfg` whose dataclass's `check_available`
    refuses it, depth first; None: all are available."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        return None
    try:
        if hasattr(cfg, "check_available"):
            cfg.check_available()
    except FieldError as e:
        return _join(prefix, e.field), e.detail
    except ValueError as e:
        return prefix, str(e)
    for f in dataclasses.fields(cfg):
        if (refused := _unavailable(getattr(cfg, f.name), _join(prefix, f.name))) is not None:
            return refused
    return None


def _join(prefix: str, key: str) -> str:
    """`prefix.key`, or `key` at the top ("")."""
    return f"{prefix}.{key}" if prefix else key


def _sources(key: str, applied: list[tuple[str, str]], default: str) -> str:
    """The sources that set `key`, a key inside it or one holding it, in the order applied."""
    found = dict.fromkeys(source for k, source in applied if _overlaps(k, key))
    return " and ".join(found) or default


def _overlaps(a: str, b: str) -> bool:
    """Whether dotted keys `a` and `b` are equal or one lies inside the other ("" holds all)."""
    short, long = sorted((a, b), key=len)
    return not short or long == short or long.startswith((f"{short}.", f"{short}["))


def _error(source: str, key: str, detail: str) -> ConfigError:
    return ConfigError(": ".join(part for part in (source, key, detail) if part))


def _unknown_key(node: DictConfig, key: str, e: ConfigKeyError) -> str:
    """What a key the schema lacks is: one its dataclass renamed or removed (its RENAMED_KEYS
    say where it went), else unknown, with the closest known key."""
    return _renamed(node, key) or "unknown key" + _suggestion(e)


def _renamed(node: DictConfig, key: str) -> str | None:
    """Where `key` of `node` went, from its dataclass's RENAMED_KEYS; None: it did not move."""
    return getattr(OmegaConf.get_type(node), "RENAMED_KEYS", {}).get(key)


def _suggestion(e: ConfigKeyError) -> str:
    known = [str(k) for k in e.parent_node] if isinstance(e.parent_node, DictConfig) else []
    close = difflib.get_close_matches(str(e.key), known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _first_line(e: OmegaConfBaseException) -> str:
    """omegaconf's message without the lines of node metadata it appends."""
    return str(e).partition("\n")[0]


def _yaml_problem(e: yaml.YAMLError) -> str:
    return getattr(e, "problem", None) or str(e)


def _shape(value: Any) -> str | None:
    """Whether `value` (plain or omegaconf) is a mapping, a list, or neither (None)."""
    if isinstance(value, dict | DictConfig):
        return "a mapping"
    if isinstance(value, list | ListConfig):
        return "a list"
    return None
