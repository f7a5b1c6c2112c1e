"""The loop every app shares: actors, publishing weights, eval, metrics, shutdown."""

from forge.loop.config import EvalConfig, RLConfig, RunConfig
from forge.loop.evaluation import Evaluator
from forge.loop.generator_handle import GeneratorHandle
from forge.loop.rl import RLLoop
from forge.loop.run import Run
from forge.loop.run_folder import RunFinished, RunFolderError
from forge.loop.startup import RunParts
from forge.loop.trainer_handle import TrainerDied, TrainerHandle

__all__ = [
    "EvalConfig",
    "Evaluator",
    "GeneratorHandle",
    "RLConfig",
    "RLLoop",
    "Run",
    "RunConfig",
    "RunFinished",
    "RunFolderError",
    "RunParts",
    "TrainerDied",
    "TrainerHandle",
]
