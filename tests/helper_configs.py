"""The shipped configs and the app each config folder belongs to (unit tests of configs)."""

from pathlib import Path

ROOT = Path(__file__).parents[1]
# Config folder -> the app (apps/<app>/main.py) its configs are written for.
APPS = {"grpo": "grpo", "agent": "grpo", "distillation": "distillation", "sft": "sft"}
# The apps' configs; configs/serve/ holds `forge serve`'s (forge.serve.tinker.config).
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*/*.yaml") if p.parent.name != "serve")
SERVE_CONFIGS = sorted((ROOT / "configs" / "serve").glob("*.yaml"))
