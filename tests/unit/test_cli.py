"""forge.cli: `forge run APP_PATH --config FILE key=value ...` on a tiny app written per test."""

import subprocess
import sys
from pathlib import Path

import pytest

from forge.cli import main

REPO = Path(__file__).parents[2]

APP = """
from dataclasses import dataclass, field

import cloudpickle


@dataclass
class OptimConfig:
    lr: float = 1e-3


@dataclass
class HelloConfig:
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


def test_app_code_reaches_processes_that_cannot_import_it(app, tmp_path):
    # Actor processes get what the app defines by value: they cannot import the app by name.
    blob = tmp_path / "double.pkl"
    assert forge("run", str(app), f"pickle_to={blob}").returncode == 0
    load = f"import cloudpickle; print(cloudpickle.load(open({str(blob)!r}, 'rb'))(21))"
    result = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert result.stdout == "42\n", result.stderr


def test_sync_main_without_config_file(tmp_path, capsys):
    app = tmp_path / "sync.py"
    app.write_text(APP.replace("async def main", "def main"))
    main(["run", str(app), "name=sync"])
    assert capsys.readouterr().out == "HelloConfig name=sync steps=1 lr=0.001\n"


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("x = 1\n", "defines no main(cfg)"),
        ("def main(cfg):\n    pass\n", "the first parameter of main must be annotated"),
        ("def main(cfg: int):\n    pass\n", "the first parameter of main must be annotated"),
    ],
)
def test_app_without_a_config_main(tmp_path, capsys, source, error):
    app = tmp_path / "bad.py"
    app.write_text(source)
    with pytest.raises(SystemExit) as info:
        main(["run", str(app)])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(f"forge: error: {app}: {error}")


def test_app_file_not_found(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", str(tmp_path / "nope.py")])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"forge: error: {tmp_path / 'nope.py'}: not a python file\n"
