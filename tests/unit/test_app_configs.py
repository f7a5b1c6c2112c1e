"""Every shipped app config loads onto its app's dataclass (GPU and SLURM ones included, which
cannot run here): a wrong key or type in them fails this test, not a cluster job."""

from pathlib import Path

import pytest

from forge.cli import load_app
from forge.config import ConfigError, load_config

ROOT = Path(__file__).parents[2]
CONFIGS = sorted((ROOT / "configs" / "grpo").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_grpo_config_loads(path):
    _, schema = load_app(ROOT / "apps" / "grpo" / "main.py")
    cfg = load_config(schema, path)
    assert cfg.buffer.batch_size % cfg.group_size == 0
    assert cfg.trainer.temperature == cfg.generator.sampling.temperature


def test_a_typo_in_an_app_config_is_one_line_naming_it():
    _, schema = load_app(ROOT / "apps" / "grpo" / "main.py")
    with pytest.raises(ConfigError, match="command line: trainer.optimizer.learning_rate"):
        load_config(schema, CONFIGS[0], ["trainer.optimizer.learning_rate=1e-5"])
