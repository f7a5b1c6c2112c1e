"""`forge serve`'s configuration (configs/serve/*.yaml): where it listens, which base models it
trains, and the trainer and generator each model gets."""

from dataclasses import dataclass, field

from forge.actors.generator.config import GeneratorConfig
from forge.actors.trainer.config import TrainerConfig
from forge.config import at_least, field_error, positive, require
from forge.models import check_model
from forge.weights.sync_config import WeightDtype


@dataclass
class ServeConfig:
    """The Tinker API server.

    Args:
        host: the address it listens on; 127.0.0.1 (this machine only) unless told otherwise.
        port: its port; 0: one the system picks. Either way `state_dir/serve.json` names it.
        state_dir: the server's folder: its key (`api_key`, readable by its owner only, unless
            TINKER_API_KEY is set when it starts), its address, and one folder per model
            (settings, saved states) that a restarted server loads from.
        base_models: the models `create_model` accepts, by the name a client sends (a name
            forge.models resolves, or a local Hugging Face folder).
        dtype: the sampler engines' dtype, which each saved version is published in.
        lora_alpha: the adapters' alpha (their output is scaled by alpha / rank).
        max_models: training models held at once, over every session; a further
            `create_model` is refused until one is gone.
        max_pending: requests queued per model; a further one is refused (the SDK retries).
        heartbeat_timeout_s: a session whose client has not sent a heartbeat (the SDK sends
            one every 10 s) for this long is closed, and its models' processes and memory
            given back.
        trainer: every model's trainer (its `model` is the base model, set per model).
        generator: every model's sampler engine (its `model` likewise).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    state_dir: str = "runs/serve"
    base_models: list[str] = field(default_factory=lambda: ["tiny-llama"])
    dtype: WeightDtype = "float32"
    lora_alpha: float = 32.0
    max_models: int = 4
    max_pending: int = 64
    heartbeat_timeout_s: float = 60.0
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)

    def __post_init__(self) -> None:
        require(self, "port", lambda p: 0 <= p < 65536, "a port number (0: any free one)")
        require(self, "base_models", bool, "at least one model")
        at_least(self, 1, "max_models", "max_pending")
        positive(self, "lora_alpha", "heartbeat_timeout_s")

    def check_available(self) -> None:
        """Raises FieldError unless every base model resolves on this machine."""
        with field_error("base_models"):
            for name in self.base_models:
                check_model(name)
