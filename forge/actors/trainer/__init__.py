"""The trainer: a torchtitan model in an actor (`actor.py`) composed of parts, each on the
model one rank holds (`model.py`): building it (`build.py`), the training step (`training.py`,
with its micro-batches in `micro_batches.py` and the generator-vs-trainer KL in
`mismatch.py`), calibration (`calibrate.py`), publishing versions (`publish.py`) and Hugging
Face export (`export.py`); its configuration is in `config.py`."""

from forge.actors.trainer.actor import TitanTrainer
from forge.actors.trainer.config import OptimizerConfig, SchedulerConfig, TrainerConfig

__all__ = ["OptimizerConfig", "SchedulerConfig", "TitanTrainer", "TrainerConfig"]
