"""Supervised fine-tuning with tinker-cookbook's own loop against `forge serve`.

The loop is the cookbook's `tinker_cookbook.supervised.train.main`, unchanged; this script only
builds its config, as the cookbook's `recipes/sl_basic.py` does, with two differences that this
machine needs: the data is the cookbook's shipped `example_data/conversations.jsonl` (no hub),
and the model is a local folder. Every field of the cookbook's `train.Config` can be set on the
command line (chz syntax, `key=value`), `base_url` included.

It runs in the Tinker client environment (`make tinker-env` builds `.venv-tinker`) and does
not import forge:

    .venv-tinker/bin/python examples/tinker/sl_conversations.py \\
        base_url=http://127.0.0.1:8000 model_name=/path/to/SmolLM2-135M-Instruct max_steps=8
"""

from importlib.resources import files

import chz
from client_settings import run
from tinker_cookbook import cli_utils
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig


def build_config_blueprint(model_name: str, renderer_name: str) -> chz.Blueprint[train.Config]:
    """The cookbook's supervised config over its example conversations, small batches."""
    conversations = files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    return chz.Blueprint(train.Config).apply(
        {
            "log_path": cli_utils.runs_path("forge-sl-conversations"),
            "model_name": model_name,
            "recipe_name": "forge_sl_conversations",
            "renderer_name": renderer_name,
            # The classes and their fields apart, so that `dataset_builder.test_size=...` and
            # the like can be set on the command line.
            "dataset_builder": FromConversationFileBuilder,
            "dataset_builder.file_path": str(conversations),
            "dataset_builder.test_size": 16,
            "dataset_builder.common_config": ChatDatasetBuilderCommonConfig,
            "dataset_builder.common_config.model_name_for_tokenizer": model_name,
            "dataset_builder.common_config.renderer_name": renderer_name,
            "dataset_builder.common_config.max_length": 512,
            "dataset_builder.common_config.batch_size": 8,
            "dataset_builder.common_config.train_on_what": TrainOnWhat.ALL_ASSISTANT_MESSAGES,
            "learning_rate": 1e-4,
            "lr_schedule": "constant",
            "lora_rank": 16,
            "num_epochs": 1,
            "eval_every": 4,
            "save_every": 0,
        }
    )


if __name__ == "__main__":
    run(build_config_blueprint, train.main)
