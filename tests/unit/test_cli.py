"""forge.cli: `forge run APP_PATH --config FILE key=value ...` on a tiny app written per test;
`forge config show`, `forge --version`, and the examples the help gives."""

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from forge import cli
from forge.cli import EXAMPLE_CONFIG, load_app, main
from forge.config import load_config
from forge.config_fields import settings

REPO = Path(__file__).parents[2]

APP = """
from dataclasses import dataclass, field

import cloudpickle


@dataclass
class OptimConfig:
    lr: float = 1e-3


@dataclass
class HelloConfig:
    '''A greeting.

    Args:
        name: who is greeted.
    '''

    name: str = "world"
    steps: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    pickle_to: str | None = None


def double(x):
    return 2 * x


async def main(cfg: HelloConfig) -> None:
    print(f"{type(cfg).__name__} name={cfg.name} steps={cfg.steps} lr={cfg.optim.lr}")
    if cfg.pickle_to:
        with open(cfg.pickle_to, "wb") as f:
            cloudpickle.dump(double, f)
"""


@pytest.fixture
def app(tmp_path: Path) -> Path:
    path = tmp_path / "hello.py"
    path.write_text(APP)
    (tmp_path / "hello.yaml").write_text("name: forge\nsteps: 2\n")
    return path


@pytest.fixture
def empty_config(tmp_path: Path) -> Path:
    """A config file that sets nothing: the app's defaults."""
    path = tmp_path / "empty.yaml"
    path.write_text("")
    return path


def forge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "forge", *args], cwd=REPO, capture_output=True, text=True
    )


def test_run_loads_config_and_calls_async_main(app):
    config = app.with_suffix(".yaml")
    result = forge("run", str(app), "--config", str(config), "steps=3", "optim.lr=1e-4")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "HelloConfig name=forge steps=3 lr=0.0001\n"


def test_run_config_error_exits_2_with_one_line(app):
    result = forge("run", str(app), "--config", str(app.with_suffix(".yaml")), "stepz=3")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "forge: config error: command line: stepz: unknown key (did you mean 'steps'?)\n"
    )


GRPO, AGENT = "configs/grpo/tiny_cpu.yaml", "configs/agent/tiny_cpu.yaml"
MODELS = "expected 'SmolLM2-135M-Instruct', 'tiny-llama', 'tiny-qwen3' or a local directory"
BAD_VALUES = [
    # (config, override, the key and cause that end the line)
    (GRPO, "trainer.model=nope", f"trainer.model: unknown model 'nope': {MODELS}"),
    (GRPO, "generator.model=nope", f"generator.model: unknown model 'nope': {MODELS}"),
    (GRPO, "trainer.model=''", "trainer.model: must be a model name or folder, got ''"),
    (GRPO, "trainer.optimizer.lr=-1", "trainer.optimizer.lr: must be > 0, got -1.0"),
    (GRPO, "group_size=0", "group_size: must be >= 1, got 0"),
    (GRPO, "group_size=-1", "group_size: must be >= 1, got -1"),
    (GRPO, "generator.sampling.max_tokens=0", "generator.sampling.max_tokens: must be >= 1, got 0"),
    (GRPO, "steps=-1", "steps: must be >= 1, got -1"),
    (AGENT, "env.options.hihg=4",
     "env.options.hihg: forge.envs.tasks:GuessNumber takes no option 'hihg' (did you mean "
     "'high'?)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("config", "override", "error"), BAD_VALUES, ids=[b[1] for b in BAD_VALUES]
)
def test_a_bad_value_stops_forge_run_in_one_line_before_anything_starts(
    config, override, error, tmp_path, capsys, monkeypatch
):
    def start(*args):
        raise AssertionError("the app's main ran")

    monkeypatch.setattr(cli, "_run_app", start)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["run", str(REPO / "apps/grpo/main.py"), "--config", str(REPO / config),
              f"run_dir={run_dir}", override])  # fmt: skip
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("forge: config error: ") and err.count("\n") == 1
    assert f"command line: {error}" in err, err
    assert not run_dir.exists()


def test_a_value_out_of_range_is_one_line_from_the_forge_command(tmp_path):
    # Once a ZeroDivisionError's traceback: the real command, its output and exit status.
    result = forge("run", "apps/grpo/main.py", "--config", GRPO, f"run_dir={tmp_path}/run",
                   "group_size=0")  # fmt: skip
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"forge: config error: {GRPO} and command line: group_size: must be >= 1, got 0\n"
    )
    assert not (tmp_path / "run").exists()


FAILING_APP = """
from dataclasses import dataclass

from monarch.actor import ActorError


@dataclass
class Config:
    run_dir: str = "runs/x"


def main(cfg: Config) -> None:
    # As Monarch raises it when an actor's setup fails: its message names only the call.
    cause = ValueError("unknown model 'nope'\\nsecond line")
    raise ActorError(cause, "Actor call TitanTrainer.setup failed.")
"""


def test_an_actors_error_reaches_the_console_as_its_cause(tmp_path, empty_config):
    app = tmp_path / "failing.py"
    app.write_text(FAILING_APP)
    run_dir = tmp_path / "run"
    result = forge("run", str(app), "--config", str(empty_config), f"run_dir={run_dir}")
    assert result.returncode == 1
    assert result.stdout.splitlines()[-1] == (
        f"forge: run failed: TitanTrainer.setup: ValueError: unknown model 'nope' "
        f"(details: {run_dir / 'forge.log'})"
    )
    assert "second line" in (run_dir / "forge.log").read_text()  # the whole traceback


def test_the_gist_of_nested_actor_errors_is_the_innermost_cause():
    from monarch.actor import ActorError

    inner = ActorError(KeyError("w"), "Actor call Generator.update failed.")
    assert cli._gist(ActorError(inner, "Actor call TitanTrainer.publish failed.")) == (
        "TitanTrainer.publish: KeyError: 'w'"
    )
    assert cli._gist(ActorError(RuntimeError(), "another message")) == (
        "another message: RuntimeError"
    )
    assert cli._gist(OSError("disk full")) == "OSError: disk full"


def test_a_call_failed_by_its_actors_process_dying_names_the_actor_and_how_it_died():
    from forge.controller import SupervisionError

    def failed(status: str) -> SupervisionError:  # as torchmonarch 0.7 words it
        return SupervisionError(
            "Endpoint call ReplayBuffer.add() failed, The actor <root>.<ReplayBuffer> and all its "
            f"descendants have failed:\n  the process this actor was running on failed: {status}"
        )

    assert cli._process_death(failed("Killed(sig=9)")) == (
        "ReplayBuffer's process was killed by SIGKILL (in ReplayBuffer.add)"
    )
    try:
        raise RuntimeError("a later failure") from failed("Stopped(exit=3)")
    except RuntimeError as wrapped:
        assert cli._process_death(wrapped) == (
            "ReplayBuffer's process exited with status 3 (in ReplayBuffer.add)"
        )
    assert cli._process_death(failed("Failed(bootstrap error)")) is None  # told by _gist
    assert cli._process_death(OSError("disk full")) is None


def test_app_code_reaches_processes_that_cannot_import_it(app, tmp_path):
    # Actor processes get what the app defines by value: they cannot import the app by name.
    blob = tmp_path / "double.pkl"
    config = app.with_suffix(".yaml")
    assert forge("run", str(app), "--config", str(config), f"pickle_to={blob}").returncode == 0
    load = f"import cloudpickle; print(cloudpickle.load(open({str(blob)!r}, 'rb'))(21))"
    result = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert result.stdout == "42\n", result.stderr


def test_sync_main(tmp_path, capsys, empty_config):
    app = tmp_path / "sync.py"
    app.write_text(APP.replace("async def main", "def main"))
    main(["run", str(app), "--config", str(empty_config), "name=sync"])
    assert capsys.readouterr().out == "HelloConfig name=sync steps=1 lr=0.001\n"


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("x = 1\n", "defines no main(cfg)"),
        ("def main(cfg):\n    pass\n", "the first parameter of main must be annotated"),
        ("def main(cfg: int):\n    pass\n", "the first parameter of main must be annotated"),
    ],
)
def test_app_without_a_config_main(tmp_path, capsys, empty_config, source, error):
    app = tmp_path / "bad.py"
    app.write_text(source)
    with pytest.raises(SystemExit) as info:
        main(["run", str(app), "--config", str(empty_config)])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(f"forge: error: {app}: {error}")


def test_app_file_not_found(tmp_path, capsys, empty_config):
    with pytest.raises(SystemExit) as info:
        main(["run", str(tmp_path / "nope.py"), "--config", str(empty_config)])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"forge: error: {tmp_path / 'nope.py'}: not a python file\n"


@pytest.mark.parametrize("command", [["run"], ["submit"], ["plan"], ["config", "show"]])
def test_a_command_without_config_is_refused_with_one_line(app, capsys, command):
    # Not a run of the app's defaults: those start a SmolLM2 run nobody asked for.
    with pytest.raises(SystemExit) as info:
        main([*command, str(app), "steps=3"])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # the app's main never ran
    name = " ".join(command)
    assert (
        err == f"forge: error: forge {name} needs --config FILE, e.g. --config {EXAMPLE_CONFIG}\n"
    )
    assert (REPO / EXAMPLE_CONFIG).is_file()


def test_version_is_the_installed_distributions():
    name = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"]
    result = forge("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"forge {importlib.metadata.version(name)}\n"


def test_config_show_prints_each_setting_its_default_and_meaning(app, capsys):
    main(["config", "show", str(app), "--config", str(app.with_suffix(".yaml")), "optim.lr=1e-4"])
    assert capsys.readouterr().out == (
        'name = "forge"  (default: "world")  # who is greeted.\n'
        "steps = 2  (default: 1)\n"
        "optim.lr = 0.0001  (default: 0.001)\n"
        "pickle_to = null  (default: null)\n"
    )


def test_config_show_key_prints_one_section_of_an_app(capsys):
    grpo, tiny = str(REPO / "apps/grpo/main.py"), str(REPO / EXAMPLE_CONFIG)
    overrides = ["trainer.optimizer.weight_decay=0.1", "--key", "trainer.optimizer"]
    main(["config", "show", grpo, "--config", tiny, *overrides])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" = ")[0] for line in lines] == [
        f"trainer.optimizer.{name}" for name in ("lr", "betas", "eps", "weight_decay")
    ]
    assert lines[0].startswith("trainer.optimizer.lr = 0.0001  (default: 1e-05)  # the learning")
    assert lines[3].startswith("trainer.optimizer.weight_decay = 0.1  (default: 0.0)  # ")


def test_config_show_of_an_unknown_key_names_the_closest(app, capsys):
    config = str(app.with_suffix(".yaml"))
    with pytest.raises(SystemExit) as info:
        main(["config", "show", str(app), "--config", config, "--key", "optim.rl"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "forge: config error: --key optim.rl: no such setting or section (did you mean "
        "'optim.lr'?)\n"
    )


def test_config_show_refuses_what_run_refuses(app, capsys):
    # The same loading: a config `forge run` would refuse is not shown as if it were fine.
    config = str(app.with_suffix(".yaml"))
    errors = []
    for command in (["run"], ["config", "show"]):
        with pytest.raises(SystemExit):
            main([*command, str(app), "--config", config, "optim.lr=fast"])
        errors.append(capsys.readouterr().err)
    assert errors[0] == errors[1]
    assert errors[0].startswith("forge: config error: command line: optim.lr: ")


def help_texts(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """The --help of every command and subcommand, by command ("" for `forge` itself)."""
    texts, commands = {}, [""]
    while commands:
        command = commands.pop()
        with pytest.raises(SystemExit):
            main([*command.split(), "--help"])
        texts[command] = capsys.readouterr().out
        if choices := re.search(r"^commands:\n  \{([\w,]+)\}", texts[command], re.MULTILINE):
            commands += [f"{command} {name}".strip() for name in choices[1].split(",")]
    return texts


def test_every_example_in_the_help_is_a_real_key(capsys):
    texts = help_texts(capsys)
    assert {"run", "submit", "plan", "replay", "config show"} <= set(texts)
    text = "\n".join([cli.__doc__ or "", *texts.values()])
    overrides = set(re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+=[^\s,;)`]+", text))
    sections = set(re.findall(r"--key ([a-z_.]+)", text))
    assert "trainer.optimizer.lr=1e-4" in overrides and sections  # the patterns find examples
    tiny = REPO / EXAMPLE_CONFIG
    schema = load_app(REPO / "apps/grpo/main.py")[1]
    for override in sorted(overrides):
        load_config(schema, tiny, [override])  # a key GRPO's config lacks raises ConfigError
    cfg = load_config(schema, tiny)
    assert all(settings(cfg, key) for key in sections)  # an unknown one raises ConfigError


def test_a_config_error_found_at_start_leaves_no_run_folder(tmp_path):
    """Data that is not there is found when the run opens it, after the console capture made
    the run folder: the one line is all there is to say, so the folder goes too."""
    run_dir = tmp_path / "run"
    sft = ("apps/sft/main.py", "--config", "configs/sft/tiny_cpu.yaml", f"run_dir={run_dir}")
    result = forge("run", *sft, "data.source=local", f"data.path={tmp_path / 'none.jsonl'}")
    assert result.returncode == 2
    assert "forge: config error: data: " in result.stdout + result.stderr
    assert not run_dir.exists()
