"""The generator's request layer: prompts in, Completions out.

A prompt (text, chat messages or token ids) and per-call sampling overrides become one engine
request; the engine's outputs become Completions with a policy version per token. A sequence
that an `abort`-mode weight swap cut short is continued: its prompt plus the tokens so far are
resubmitted, and the pieces stitched into one Completion.
"""

import itertools
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from forge.actors.generator.config import GeneratorConfig, SamplingConfig
from forge.data.completion import Completion


async def _no_update() -> None:
    """The default `settled`: no weight update to wait for."""


class Requests:
    """Serves `generate` calls on an engine.

    Args:
        engine: a running vLLM AsyncLLM.
        tokenizer: the engine's tokenizer.
        cfg: max_model_len and the sampling defaults.
        aborting_swaps: how many weight swaps so far aborted the running requests; a request
            that ends aborted while this moved on was cut by a swap, and is continued.
        aborting: whether such a swap is under way. A request that started after the swap
            counted itself but before the engine aborted was cut by it too, and is continued.
        settled: returns once no weight update is under way; a new request waits for it, so
            that it generates on the version an update already asked for loads.
        lora: the LoRARequest each request carries now (None: the engine serves no adapter).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        cfg: GeneratorConfig,
        aborting_swaps: Callable[[], int],
        lora: Callable[[], Any] = lambda: None,
        aborting: Callable[[], bool] = lambda: False,
        settled: Callable[[], Awaitable[None]] = _no_update,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = cfg
        self._aborting_swaps = aborting_swaps
        self._aborting = aborting
        self._lora = lora
        self._settled = settled

    async def generate(
        self,
        prompt: str | list[dict[str, str]] | list[int],
        n: int | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """`n` Completions of `prompt`; see Generator.generate."""
        prompt_ids = self.prompt_ids(prompt)
        params = self.sampling_params(n, sampling, len(prompt_ids))
        await self._settled()
        epoch = self._aborting_swaps()
        final = await self._request(prompt_ids, params)
        completions = []
        for out in final.outputs:
            sample = Sample.of(out)
            while sample.stop_reason == "abort" and self._cut_by_swap(epoch):
                epoch = self._aborting_swaps()
                sample = await self._resume(prompt_ids, sample, params)
            completions.append(sample.completion(prompt_ids, self.tokenizer))
        return completions

    async def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """The logprob of each prompt token given the ones before it (None for the first),
        under the weights the engine serves; see Generator.prompt_logprobs."""
        params = self.sampling_params(1, {"max_tokens": 1}, len(prompt_ids))
        params.prompt_logprobs = 0  # the actual token's, and no other
        await self._settled()
        final = await self._request(prompt_ids, params)
        return [
            None if position is None else position[token].logprob
            for token, position in zip(prompt_ids, final.prompt_logprobs, strict=True)
        ]

    def _cut_by_swap(self, epoch: int) -> bool:
        return self._aborting() or self._aborting_swaps() != epoch

    async def _request(self, prompt_ids: list[int], params: Any) -> Any:
        final = None
        request = {"prompt_token_ids": prompt_ids}
        async for out in self.engine.generate(
            request, params, request_id=uuid.uuid4().hex, lora_request=self._lora()
        ):
            final = out
        return final

    async def _resume(self, prompt_ids: list[int], sample: "Sample", params: Any) -> "Sample":
        left = params.max_tokens - len(sample.token_ids)
        if left <= 0:
            sample.stop_reason = "length"
            return sample
        more = params.clone()
        more.n, more.max_tokens, more.seed = 1, left, None
        out = (await self._request(prompt_ids + sample.token_ids, more)).outputs[0]
        return sample.extend(Sample.of(out))

    def prompt_ids(self, prompt: str | list[dict[str, str]] | list[int]) -> list[int]:
        """Token ids of a text, of chat messages (with the model's chat template), or as given."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt.strip() else []
        elif prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        elif all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("prompt must be text, a list of chat messages or a list of token ids")
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def sampling_params(self, n: int | None, overrides: dict | None, prompt_len: int) -> Any:
        """vLLM SamplingParams: the configured defaults, `overrides` and `n` over them."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        values = {**self.cfg.sampling.__dict__, **(overrides or {})}
        if n is not None:
            values["n"] = n
        unknown = set(values) - set(SamplingConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling parameters {sorted(unknown)}")
        room = self.cfg.max_model_len - prompt_len
        if room < values["max_tokens"]:
            raise ValueError(
                f"prompt of {prompt_len} tokens leaves {room} of the model's "
                f"{self.cfg.max_model_len}-token context; max_tokens is {values['max_tokens']}"
            )
        try:
            return SamplingParams(
                **values,
                logprobs=0,
                output_kind=RequestOutputKind.FINAL_ONLY,
                detokenize=bool(values["stop"]),  # stop strings are matched in the text
            )
        except (ValueError, VLLMValidationError) as e:
            raise ValueError(f"bad sampling parameters: {e}") from None


@dataclass
class Sample:
    """One sequence being built, possibly from several engine requests (abort-and-resume)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str

    @classmethod
    def of(cls, out: Any) -> "Sample":
        """From a vLLM CompletionOutput; a request that ended without a reason was aborted."""
        tokens = list(out.token_ids)
        logprobs = [pos[t].logprob for t, pos in zip(tokens, out.logprobs or [], strict=True)]
        versions = list(
            itertools.chain.from_iterable(
                [int(s.version)] * (s.end - s.start) for s in out.weight_versions or []
            )
        )
        return cls(tokens, logprobs, versions, out.finish_reason or "abort")

    def extend(self, more: "Sample") -> "Sample":
        """This sequence continued by `more` (the resubmitted request's output)."""
        return Sample(
            self.token_ids + more.token_ids,
            self.logprobs + more.logprobs,
            self.versions + more.versions,
            more.stop_reason,
        )

    def completion(self, prompt_ids: list[int], tokenizer: Any) -> Completion:
        return Completion(
            prompt_ids=prompt_ids,
            token_ids=self.token_ids,
            text=tokenizer.decode(self.token_ids, skip_special_tokens=True),
            logprobs=self.logprobs,
            token_versions=self.versions,
            stop_reason=self.stop_reason,
        )
