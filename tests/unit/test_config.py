"""forge.config: yaml + overrides onto dataclasses, and a one-line ConfigError for bad input."""

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import ClassVar, Literal

import pytest
from omegaconf import MISSING

from forge.config import (
    ConfigError,
    FieldError,
    at_least,
    check_available,
    load_config,
    positive,
)


class UpdateMode(Enum):
    drain = "drain"
    abort = "abort"
    inflight = "inflight"


@dataclass
class OptimConfig:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class TrainerConfig:
    steps: int = 10
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint_dir: str = "${run_name}/checkpoints"


@dataclass
class GeneratorConfig:
    update_mode: UpdateMode = UpdateMode.drain
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_policy_age: int = 1

    def __post_init__(self) -> None:
        if self.update_mode is UpdateMode.inflight and self.max_policy_age == 0:
            raise ValueError("update_mode inflight needs max_policy_age >= 1")


@dataclass
class ReferenceConfig:
    model: str = MISSING


@dataclass
class AppConfig:
    model: str = MISSING
    run_name: str = "${model}-run"
    tags: dict[str, str] = field(default_factory=dict)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reference: ReferenceConfig | None = None


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "app.yaml"
    path.write_text(text)
    return path


def config_error(path: Path | None, overrides: tuple[str, ...] = ()) -> str:
    """The message of the ConfigError that loading raises, checked to be one line."""
    with pytest.raises(ConfigError) as info:
        load_config(AppConfig, path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


# Loading


def test_yaml_overrides_and_interpolation_give_the_typed_dataclass(tmp_path):
    path = write(tmp_path, "model: smollm\ntrainer:\n  steps: 5\n  optim:\n    lr: 1e-3\n")
    cfg = load_config(AppConfig, path, ["trainer.optim.lr=1e-4", "generator.update_mode=abort"])
    assert isinstance(cfg, AppConfig)
    assert isinstance(cfg.trainer, TrainerConfig)
    assert isinstance(cfg.trainer.optim, OptimConfig)
    assert cfg.trainer.steps == 5
    assert cfg.trainer.optim.lr == 1e-4
    assert cfg.generator.update_mode is UpdateMode.abort
    assert cfg.run_name == "smollm-run"
    assert cfg.trainer.checkpoint_dir == "smollm-run/checkpoints"
    assert cfg.reference is None


def test_overrides_apply_after_the_file_and_in_order(tmp_path):
    path = write(tmp_path, "model: smollm\ntrainer:\n  steps: 5\n")
    cfg = load_config(AppConfig, path, ["trainer.steps=7", "model=qwen", "trainer.steps=8"])
    assert cfg.trainer.steps == 8
    assert cfg.run_name == "qwen-run"


def test_list_dict_and_optional_dataclass_overrides(tmp_path):
    overrides = [
        "model=smollm",
        "trainer.optim.betas=[0.8, 0.95]",
        "tags.team=rl",
        "reference.model=teacher",
        "generator.dtype=bfloat16",
    ]
    cfg = load_config(AppConfig, None, overrides)
    assert cfg.trainer.optim.betas == [0.8, 0.95]
    assert cfg.tags == {"team": "rl"}
    assert cfg.reference == ReferenceConfig(model="teacher")
    assert cfg.generator.dtype == "bfloat16"


def test_empty_file_keeps_the_defaults(tmp_path):
    cfg = load_config(AppConfig, write(tmp_path, ""), ["model=smollm"])
    assert cfg == AppConfig(
        model="smollm",
        run_name="smollm-run",
        trainer=TrainerConfig(checkpoint_dir="smollm-run/checkpoints"),
    )


# Errors: each names the source and the full dotted key, on one line.


def test_unknown_top_level_key(tmp_path):
    path = write(tmp_path, "model: smollm\nmodle: qwen\n")
    assert config_error(path) == f"{path}: modle: unknown key (did you mean 'model'?)"


def test_unknown_nested_key(tmp_path):
    path = write(tmp_path, "model: smollm\ntrainer:\n  optim:\n    lr_max: 1.0\n")
    assert config_error(path) == f"{path}: trainer.optim.lr_max: unknown key"


def test_wrong_type(tmp_path):
    path = write(tmp_path, "model: smollm\ntrainer:\n  steps: many\n")
    assert config_error(path).startswith(f"{path}: trainer.steps: Value 'many' of type 'str'")


def test_missing_required_value(tmp_path):
    path = write(tmp_path, "trainer:\n  steps: 5\n")
    assert config_error(path) == f"{path}: model: missing required value"


def test_missing_required_value_without_a_file():
    assert config_error(None) == "command line: model: missing required value"


def test_unknown_key_in_override(tmp_path):
    path = write(tmp_path, "model: smollm\n")
    message = config_error(path, ("trainer.stepz=3",))
    assert message == "command line: trainer.stepz: unknown key (did you mean 'steps'?)"


def test_wrong_type_in_override(tmp_path):
    path = write(tmp_path, "model: smollm\n")
    message = config_error(path, ("trainer.optim.lr=fast",))
    assert message.startswith("command line: trainer.optim.lr: Value 'fast' of type 'str'")


def test_override_without_equals(tmp_path):
    path = write(tmp_path, "model: smollm\n")
    assert (
        config_error(path, ("trainer.steps",))
        == "command line: 'trainer.steps': expected key=value"
    )


def test_override_value_that_is_not_yaml(tmp_path):
    path = write(tmp_path, "model: smollm\n")
    message = config_error(path, ("trainer.optim.betas=[0.9,",))
    assert message.startswith("command line: trainer.optim.betas: cannot parse '[0.9,': ")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "model: smollm\ntrainer:\n  steps: 5\n   optim: 1\n")
    assert config_error(path).startswith(f"{path}:4: yaml syntax error: ")


def test_duplicate_yaml_key(tmp_path):
    path = write(tmp_path, "model: smollm\nmodel: qwen\n")
    assert config_error(path) == f"{path}:2: yaml syntax error: found duplicate key model"


def test_file_not_found(tmp_path):
    path = tmp_path / "nope.yaml"
    message = config_error(path)
    assert message == f"{path}: cannot read config file: No such file or directory"


def test_interpolation_to_missing_key(tmp_path):
    path = write(tmp_path, "model: smollm\ntrainer:\n  checkpoint_dir: ${output.dir}/ckpt\n")
    message = config_error(path)
    assert message.startswith(f"{path}: trainer.checkpoint_dir: ")
    assert "output.dir" in message


def test_interpolation_set_on_the_command_line(tmp_path):
    path = write(tmp_path, "model: smollm\n")
    message = config_error(path, ("run_name=${nope}",))
    assert message.startswith("command line: run_name: ")


def test_enum_value_not_among_choices(tmp_path):
    path = write(tmp_path, "model: smollm\ngenerator:\n  update_mode: pause\n")
    message = config_error(path)
    assert message.startswith(f"{path}: generator.update_mode: Invalid value 'pause'")
    assert "drain, abort, inflight" in message


def test_literal_value_not_among_choices(tmp_path):
    path = write(tmp_path, "model: smollm\n")
    message = config_error(path, ("generator.dtype=float8",))
    assert message.startswith("command line: generator.dtype: Invalid value 'float8'")


def test_impossible_combination_from_post_init(tmp_path):
    path = write(tmp_path, "model: m\ngenerator:\n  update_mode: inflight\n  max_policy_age: 0\n")
    message = config_error(path)
    assert message == f"{path}: generator: update_mode inflight needs max_policy_age >= 1"


def test_impossible_combination_across_file_and_command_line(tmp_path):
    path = write(tmp_path, "model: smollm\ngenerator:\n  update_mode: inflight\n")
    message = config_error(path, ("generator.max_policy_age=0",))
    assert message.startswith(f"{path} and command line: generator: update_mode inflight")


def test_top_level_not_a_mapping(tmp_path):
    path = write(tmp_path, "- model\n- smollm\n")
    assert config_error(path) == f"{path}: top level must be a mapping of keys, got a list"


def test_list_where_a_dataclass_is_expected(tmp_path):
    path = write(tmp_path, "model: smollm\ntrainer:\n  - steps\n")
    assert config_error(path) == f"{path}: trainer: expected a mapping, got a list"


def test_mapping_where_a_list_is_expected(tmp_path):
    path = write(tmp_path, "model: smollm\ntrainer:\n  optim:\n    betas: {first: 0.9}\n")
    message = config_error(path)
    assert message == f"{path}: trainer.optim.betas: expected a list, got a mapping"


def test_list_where_a_mapping_is_expected_in_override(tmp_path):
    path = write(tmp_path, "model: smollm\n")
    assert (
        config_error(path, ("tags=[rl]",)) == "command line: tags: expected a mapping, got a list"
    )


def test_multi_line_post_init_message_becomes_one_line(tmp_path):
    @dataclass
    class Picky:
        x: int = 0

        def __post_init__(self) -> None:
            raise ValueError("x is wrong\nand so is y")

    with pytest.raises(ConfigError, match=r"^command line: x is wrong and so is y$"):
        load_config(Picky, None, ["x=1"])


@dataclass
class Buffer:
    batch_size: int = 8
    ranks: int = 1  # derived: the run fills it in

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "ranks": "derived from workers: remove it",
        "size": "renamed to batch_size",
    }


@dataclass
class Run:
    workers: int = 2
    buffer: Buffer = field(default_factory=Buffer)

    def __post_init__(self) -> None:
        self.buffer.ranks = self.workers


def test_a_renamed_key_names_where_it_went(tmp_path):
    path = write(tmp_path, "buffer: {size: 4}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: buffer.size: renamed to batch_size$"):
        load_config(Run, path)


def test_a_derived_key_is_refused_in_input_naming_where_it_comes_from(tmp_path):
    path = write(tmp_path, "buffer: {ranks: 4}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: buffer.ranks: derived from workers: remove"):
        load_config(Run, path)
    with pytest.raises(ConfigError, match="^command line: buffer.ranks: derived from workers"):
        load_config(Run, None, ["buffer.ranks=4"])
    assert load_config(Run, None, ["workers=3"]).buffer.ranks == 3


def test_a_saved_config_holds_the_derived_values(tmp_path):
    """A run folder's config.yaml (read with known_only) is the config as it ran."""
    path = write(tmp_path, "workers: 3\nbuffer: {batch_size: 8, ranks: 3}\nother_app_key: 1\n")
    assert load_config(Run, path, known_only=True).buffer.ranks == 3


# Field checks: a __post_init__ refusing one field names its full key.


@dataclass
class Sampling:
    max_tokens: int = 8
    top_p: float | None = None

    def __post_init__(self) -> None:
        at_least(self, 1, "max_tokens")
        positive(self, "top_p")  # None: unset, not checked


@dataclass
class Engine:
    model: str = "tiny"
    sampling: Sampling = field(default_factory=Sampling)
    steps: int = 1

    def __post_init__(self) -> None:
        at_least(self, 0, "steps")

    def check_available(self) -> None:
        if self.model != "tiny":
            raise FieldError("model", f"unknown model {self.model!r}")


@dataclass
class Top:
    engine: Engine = field(default_factory=Engine)
    group_size: int = 4

    def __post_init__(self) -> None:
        at_least(self, 1, "group_size")


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("engine.sampling.max_tokens=0", "engine.sampling.max_tokens: must be >= 1, got 0"),
        ("engine.sampling.top_p=-0.5", "engine.sampling.top_p: must be > 0, got -0.5"),
        ("engine.steps=-1", "engine.steps: must be >= 0, got -1"),
        ("group_size=0", "group_size: must be >= 1, got 0"),
    ],
)
def test_a_value_out_of_its_range_names_its_full_key(override, error):
    with pytest.raises(ConfigError) as info:
        load_config(Top, None, [override])
    assert str(info.value) == f"command line: {error}"


def test_a_field_error_outside_the_loader_names_the_field():
    with pytest.raises(FieldError, match="^max_tokens: must be >= 1, got 0$"):
        Sampling(max_tokens=0)


def test_what_must_be_on_this_machine_is_checked_when_asked(tmp_path):
    path = write(tmp_path, "engine: {model: huge}\n")
    assert load_config(Top, path).engine.model == "huge"  # `forge config show`, `forge plan`
    with pytest.raises(ConfigError, match=rf"^{path}: engine.model: unknown model 'huge'$"):
        load_config(Top, path, available=True)  # `forge run`
    with pytest.raises(ConfigError, match="^engine.model: unknown model 'huge'$"):
        check_available(load_config(Top, path))  # a config built in Python


# YAML 1.1 booleans given to a choice


class Power(Enum):
    on = "on"
    standby = "standby"


@dataclass
class Choices:
    action: Literal["skip", "stop", "off"] = "skip"
    switch: Literal["on", "auto"] | None = None
    mode: UpdateMode = UpdateMode.drain
    power: Power = Power.standby
    answer: Literal["yes", "y", "no"] = "no"  # two words for True
    flag: Literal[True, "auto"] = "auto"  # True is a choice itself


@pytest.mark.parametrize("where", ["file", "command line"])
def test_a_choice_that_yaml_reads_as_a_boolean_is_taken_as_the_word(tmp_path, where):
    text = {"action": "off", "switch": "On", "power": "ON"}
    path = write(tmp_path, "".join(f"{k}: {v}\n" for k, v in text.items()))
    if where == "file":
        cfg = load_config(Choices, path)
    else:
        cfg = load_config(Choices, None, [f"{k}={v}" for k, v in text.items()])
    assert (cfg.action, cfg.switch, cfg.power) == ("off", "on", Power.on)
    assert load_config(Choices, None, ["flag=yes"]).flag is True


def test_a_boolean_no_choice_or_two_choices_spell_is_refused():
    with pytest.raises(ConfigError, match="^command line: action: Invalid value 'True'"):
        load_config(Choices, None, ["action=on"])  # off, but not on, is a choice
    with pytest.raises(ConfigError, match="^command line: answer: Invalid value 'True'"):
        load_config(Choices, None, ["answer=yes"])  # yes or y: not guessed
    with pytest.raises(ConfigError, match="^command line: mode: "):
        load_config(Choices, None, ["mode=off"])
