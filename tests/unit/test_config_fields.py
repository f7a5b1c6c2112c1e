"""forge.config_fields: the settings of a config, their defaults, and their meanings from the
config dataclasses' docstrings; every setting of every app's config has one."""

import dataclasses
from dataclasses import dataclass, field
from typing import get_args, get_type_hints

import pytest
from helper_configs import ROOT

from forge.cli import load_app, main
from forge.config import ConfigError
from forge.config_fields import meaning, settings


@dataclass
class Base:
    """A base class.

    Args:
        kept: documented here only,
            over two lines.
        low, high: the bounds.
    """

    kept: int = 1
    low: int = 0
    high: int = 2


@dataclass
class Derived(Base):
    """A subclass that documents one field again.

    Attributes:
        high: the upper bound,
            redefined.

    bare: not an entry: prose after the section.
    """

    high: int = 3
    bare: int = 0


def test_a_meaning_is_the_nearest_docstring_entry_on_one_line():
    assert meaning(Derived, "kept") == "documented here only, over two lines."
    assert meaning(Derived, "low") == "the bounds."
    assert meaning(Derived, "high") == "the upper bound, redefined."
    assert meaning(Derived, "bare") == ""


@dataclass
class Inner:
    x: int = 1


@dataclass
class Outer:
    inner: Inner = field(default_factory=lambda: Inner(x=5))
    maybe: Inner | None = None


def test_settings_walk_sections_beside_their_defaults():
    got = [(s.key, s.value, s.default) for s in settings(Outer(Inner(7), Inner(9)))]
    assert got == [("inner.x", 7, 5), ("maybe.x", 9, 1)]  # the factory's 5, Inner's own 1
    assert [(s.key, s.value) for s in settings(Outer())] == [("inner.x", 5), ("maybe", None)]


def test_settings_under_a_key():
    cfg = Outer(maybe=Inner())
    assert [s.key for s in settings(cfg, "maybe")] == ["maybe.x"]
    assert [s.key for s in settings(cfg, "inner.x")] == ["inner.x"]
    with pytest.raises(ConfigError, match=r"--key inne: no such .* \(did you mean 'inner'\?\)"):
        settings(cfg, "inne")


def leaves(schema: type, prefix: str = "") -> tuple[list[str], list[str]]:
    """The dotted keys of every leaf field of `schema`, walking each section (one that may be
    None too), and the keys of the sections that may be None; read off the type hints."""
    keys, optional = [], []
    hints = get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        args = get_args(hint)
        maybe_none = type(None) in args and len(args) == 2
        section = next(a for a in args if a is not type(None)) if maybe_none else hint
        if not dataclasses.is_dataclass(section):
            keys.append(key)
            continue
        inner_keys, inner_optional = leaves(section, f"{key}.")
        keys += inner_keys
        optional += [key] * maybe_none + inner_optional
    return keys, optional


RUN_CONFIG_APP = (
    "from forge.loop import RunConfig\n\n\ndef main(cfg: RunConfig) -> None:\n    pass\n"
)
APPS = {
    "RunConfig": None,
    "grpo": "configs/grpo/tiny_cpu.yaml",
    "distillation": "configs/distillation/tiny_cpu.yaml",
    "sft": "configs/sft/tiny_cpu.yaml",
}


@pytest.mark.parametrize("name", APPS)
def test_config_show_gives_every_setting_a_meaning(name, tmp_path, capsys):
    if APPS[name] is None:  # RunConfig itself, through an app of its own
        app, config = tmp_path / "run_config.py", tmp_path / "empty.yaml"
        app.write_text(RUN_CONFIG_APP)
        config.write_text("")
    else:
        app, config = ROOT / "apps" / name / "main.py", ROOT / APPS[name]
    expected, optional = leaves(load_app(app)[1])
    assert len(expected) > 100  # the walk found the sections
    # The sections that may be None set, so that their own settings show too.
    main(["config", "show", str(app), "--config", str(config), *(f"{k}={{}}" for k in optional)])
    shown = {}
    for line in capsys.readouterr().out.splitlines():
        key, _, rest = line.partition(" = ")
        shown[key] = rest.partition("  # ")[2]
    assert sorted(shown) == sorted(expected)
    assert [key for key, said in shown.items() if not said] == []
