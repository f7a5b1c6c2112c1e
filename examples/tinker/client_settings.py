"""What the two Tinker client scripts share: the default model and renderer, and their main:
the cookbook's config from the command line, then the cookbook's loop on it."""

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from tinker_cookbook import cli_utils

# The served model's local folder when `with_server.py` started the server (the cookbook loads
# the tokenizer from it), else its hub name.
MODEL = os.environ.get("FORGE_MODEL_DIR", "HuggingFaceTB/SmolLM2-135M-Instruct")
# SmolLM2-Instruct's chat format is ChatML, which the cookbook's qwen3_instruct renderer writes.
RENDERER = "qwen3_instruct"


def setting_from_argv(argv: list[str], key: str, default: str) -> str:
    """The last `key=value` in argv (chz's precedence), or `default`: the settings the dataset
    builder follows, which must be known before the blueprint is built."""
    value = default
    for arg in argv:
        if arg.startswith(f"{key}="):
            value = arg.removeprefix(f"{key}=")
    return value


def run(build: Callable[[str, str], Any], loop: Callable[[Any], Awaitable[None]]) -> None:
    """`loop` (the cookbook's `train.main`) on the config that `build(model, renderer)`'s
    blueprint makes from the command line; the log folder starts empty."""
    argv = sys.argv[1:]
    model_name = setting_from_argv(argv, "model_name", MODEL)
    renderer_name = setting_from_argv(argv, "renderer_name", RENDERER)
    config = build(model_name, renderer_name).make_from_argv(argv)
    cli_utils.check_log_dir(config.log_path, behavior_if_exists="delete")
    asyncio.run(loop(config))
