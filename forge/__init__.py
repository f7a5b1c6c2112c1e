"""forge: asynchronous RL post-training of language models on Monarch actors."""

from typing import Any


def __getattr__(name: str) -> Any:
    # `forge.attach` without importing torch and the actors for every `import forge.x`.
    if name == "attach":
        from forge.serve.attach import attach

        return attach
    raise AttributeError(f"module 'forge' has no attribute {name!r}")
