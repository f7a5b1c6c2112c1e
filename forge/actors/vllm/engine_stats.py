"""Engine statistics for the generator's `stats` endpoint, kept by a vLLM stat logger."""

import statistics
import time
from collections import deque
from typing import Any

# Engine steps whose intervals give `step_s`: enough for a median, few enough to follow load.
STEP_WINDOW = 16


class EngineStats:
    """vLLM's latest scheduler stats and a generated-token count.

    `factory` is passed to AsyncLLM as a stat logger factory; the engine calls its logger's
    `record` after every engine step.
    """

    def __init__(self) -> None:
        self.running = self.waiting = 0
        self.kv_cache_usage = 0.0
        self.tokens = 0
        self._last = (time.perf_counter(), 0)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW + 1)  # when each step's output came

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Logger(StatLoggerBase):
            def __init__(self) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                stats.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return Logger()

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """Takes one engine step's SchedulerStats and IterationStats (either may be None)."""
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self.tokens += iteration_stats.num_generation_tokens
            self._steps.append(iteration_stats.iteration_timestamp)

    def snapshot(self) -> dict[str, float]:
        """Tokens/s since the last snapshot, total tokens, running and waiting requests, KV use,
        `step_s`: the median interval between the last engine steps, and `last_step_s`: the
        latest one (a step that prefills new prompts runs longer than a decode step; both 0
        before two steps)."""
        now = time.perf_counter()
        then, tokens = self._last
        self._last = (now, self.tokens)
        steps = list(self._steps)
        intervals = [b - a for a, b in zip(steps, steps[1:], strict=False)]
        return {
            "tokens_per_s": (self.tokens - tokens) / max(now - then, 1e-9),
            "tokens_total": self.tokens,
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache_usage": self.kv_cache_usage,
            "step_s": statistics.median(intervals) if intervals else 0.0,
            "last_step_s": intervals[-1] if intervals else 0.0,
        }
