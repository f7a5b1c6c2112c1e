"""The generator: a vLLM engine in an actor (`actor.py`), its request layer (`requests.py`)
and its weight-update controller (`weight_updates.py`)."""

from forge.actors.generator.actor import Generator
from forge.actors.generator.config import UPDATE_MODES, GeneratorConfig, SamplingConfig, UpdateMode

__all__ = ["UPDATE_MODES", "Generator", "GeneratorConfig", "SamplingConfig", "UpdateMode"]
