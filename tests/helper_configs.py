"""The shipped configs and the app each config folder belongs to (unit tests of configs)."""

from pathlib import Path

ROOT = Path(__file__).parents[1]
# Config folder -> the app (apps/<app>/main.py) its configs are written for.
APPS = {"grpo": "grpo", "agent": "grpo", "distillation": "distillation", "sft": "sft"}
CONFIGS = sorted((ROOT / "configs").glob("*/*.yaml"))
