"""forge against one process that generates and then trains, on the same machine.

The simplest GRPO a user would write on one machine: a single Python process, with every core,
that samples a batch with `transformers`' `generate` and then takes a training step on it. This
runs that loop and the GRPO app as shipped (the config's mode, `placement: auto`) on the same
config: the same model, prompts (chat template), group size, sequences per step, sampling
(temperature, max tokens, no top-k/top-p), rewards, AdamW settings, micro-batch and gradient
clip (the learning-rate warmup aside: it costs nothing). Each run is a process of its own, so
neither side's heap or threads are left to the other. Seconds per step are the median of
steps 2-N from each step's end; the rest of a run's wall time (start-up, the first step's extra,
shutdown) is printed apart, with the step at which forge's longer start-up is paid back. The
runs alternate (baseline, forge; forge, baseline; ...) so that a drift of the machine's speed
favours neither. Printed per repeat: each one's s/step, the baseline's generate (and score)
and train seconds, tokens per step (prompt + completion, as the trainer counts them), forge /
baseline; then the median over repeats (forge's target: <= 1). Library output goes to a log
file.

    python bench/single_process.py [--sizes 16 64] [--steps 6] [--repeats 2] [k=v ...]
"""

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from async_speedup import seconds_per_step
from library_log import library_output_to_log
from placement import APP, run
from result import Result

from forge.cli import load_app
from forge.config import load_config
from forge.data.datasets import open_dataset
from forge.data.rewards import resolve_reward
from forge.losses import group_advantages
from forge.models import resolve_model
from forge.observability.console import capture_to, say


class OneProcessGRPO:
    """Generate with `transformers`, then train, in this process: the baseline."""

    def __init__(self, cfg) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(cfg.seed)
        path = resolve_model(cfg.trainer.model)
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        o = cfg.trainer.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=o.lr,
            betas=tuple(o.betas),
            weight_decay=o.weight_decay,
            fused=True,
        )
        self.dataset = open_dataset(cfg.data)
        self.rewards = [
            (resolve_reward(n), cfg.reward.weights.get(n, 1.0)) for n in cfg.reward.functions
        ]

    def step(self) -> dict[str, float]:
        cfg, group = self.cfg, self.cfg.group_size
        rows = [next(self.dataset) for _ in range(cfg.buffer.batch_size // group)]
        start = time.perf_counter()
        prompts, completions = self.generate(rows)
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = torch.tensor(
            [
                sum(w * fn(rows[i // group], text) for fn, w in self.rewards)
                for i, text in enumerate(texts)
            ]
        )
        advantages = group_advantages(rewards.view(-1, group)).flatten()
        generated = time.perf_counter()  # generated and scored, as forge's rollout time counts
        tokens = self.train(
            [p + c for p, c in zip(prompts, completions, strict=True)],
            [len(p) for p in prompts],
            advantages,
        )
        end = time.perf_counter()
        return {"generate_s": generated - start, "train_s": end - generated, "tokens": tokens}

    @torch.no_grad()
    def generate(self, rows: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
        """Each prompt's ids, `group_size` times, and the sampled completions up to eos."""
        sampling, eos = self.cfg.generator.sampling, self.tokenizer.eos_token_id
        ids = [
            self.tokenizer.apply_chat_template(
                r["prompt"], add_generation_prompt=True, return_dict=False
            )
            for r in rows
        ]
        batch = self.tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        self.model.eval()
        out = self.model.generate(
            **batch,
            do_sample=True,
            temperature=sampling.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=sampling.max_tokens,
            num_return_sequences=self.cfg.group_size,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        completions = []
        for row in out[:, batch["input_ids"].shape[1] :].tolist():
            completions.append(row[: row.index(eos) + 1] if eos in row else row)
        prompts = [p for p in ids for _ in range(self.cfg.group_size)]
        return prompts, completions

    def train(self, sequences: list[list[int]], prompt_lens: list[int], advantages) -> int:
        """One GRPO step (on-policy: the ratio is 1), token mean over the batch, in
        micro-batches of the trainer's size; the tokens it saw."""
        t = self.cfg.trainer
        self.model.train()
        total = sum(len(s) - n for s, n in zip(sequences, prompt_lens, strict=True))
        size = t.micro_batch_size or len(sequences)
        for i in range(0, len(sequences), size):
            chunk, lens = sequences[i : i + size], prompt_lens[i : i + size]
            length = max(map(len, chunk))
            ids = torch.full((len(chunk), length), self.tokenizer.pad_token_id)
            mask = torch.zeros(len(chunk), length - 1)
            for j, (s, n) in enumerate(zip(chunk, lens, strict=True)):
                ids[j, : len(s)] = torch.tensor(s)
                mask[j, n - 1 : len(s) - 1] = 1
            # Right padding under a causal mask: no real position sees a pad, so no attention
            # mask (with one, the attention leaves its fused kernel).
            logits = self.model(input_ids=ids).logits[:, :-1]
            logprobs = torch.log_softmax(logits / t.temperature, -1)
            logprobs = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
            ratio = torch.exp(logprobs - logprobs.detach())
            loss = -(advantages[i : i + size, None] * ratio * mask).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sum(map(len, sequences))


async def forge_run(config: str, overrides: list[str], steps: int) -> tuple[list[dict], str]:
    r = await run(config, "forge", ["placement=auto", *overrides], steps)
    tokens = statistics.median(m["train/tokens"] for m in r["metrics"][1:])
    chosen = r.get("chosen", {}).get("placement", "?")
    return r["metrics"], f"placement auto -> {chosen}, {tokens:.0f} tokens/step"


async def one_process_run(config: str, overrides: list[str], steps: int) -> tuple[list[dict], str]:
    cfg = load_config(load_app(APP)[1], config, overrides)
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core, to each phase in turn
    say(f"one process: {' '.join(overrides)}, {torch.get_num_threads()} threads")
    loop = OneProcessGRPO(cfg)
    m, start = [], time.perf_counter()
    for _ in range(steps):
        m.append({**loop.step(), "run/elapsed_s": time.perf_counter() - start})
    gen = statistics.median(s["generate_s"] for s in m[1:])
    train = statistics.median(s["train_s"] for s in m[1:])
    tokens = statistics.median(s["tokens"] for s in m[1:])
    return m, f"generate {gen:.1f} s + train {train:.1f} s, {tokens:.0f} tokens/step"


def measure(
    name: str, config: str, overrides: list[str], steps: int, logs: Path
) -> tuple[float, float]:
    """One run, in a process of its own (neither side's heap or threads left to the other):
    its s/step, and what its wall time holds beyond that many steps."""
    start = time.perf_counter()
    slug = name.replace(" ", "_")
    out, log = logs / f"{slug}-{start:.0f}.json", logs / f"{slug}-{start:.0f}.log"
    command = [sys.executable, __file__, "--run", name, "--out", str(out), "--log", str(log)]
    subprocess.run([*command, "--config", config, "--steps", str(steps), *overrides], check=True)
    done = json.loads(out.read_text())
    per, ends = seconds_per_step(done["metrics"]), [m["run/elapsed_s"] for m in done["metrics"]]
    # All but steps 2-N, less one step: start-up, the first step's extra, shutdown.
    rest = time.perf_counter() - start - (ends[-1] - ends[0]) - per
    say(f"  {name:<12}{per:7.2f} s/step + {rest:5.1f} s once  ({done['detail']})")
    return per, rest


async def one_run(args: argparse.Namespace) -> None:
    """The child's side of `measure`: one run in this process, its metrics to `args.out`."""
    capture_to(Path(args.log))
    runner = forge_run if args.run == "forge" else one_process_run
    metrics, detail = await runner(args.config, args.overrides, args.steps)
    keep = [{"run/elapsed_s": m["run/elapsed_s"]} for m in metrics]
    Path(args.out).write_text(json.dumps({"metrics": keep, "detail": detail}))


def repeat(config: str, overrides: list[str], steps: int, forge_first: bool, logs: Path) -> dict:
    """One baseline run and one forge run, in the given order: forge / baseline s/step, and
    the steps after which forge's longer start-up is paid back."""
    order = ["forge", "one process"] if forge_first else ["one process", "forge"]
    runs = {name: measure(name, config, overrides, steps, logs) for name in order}
    (forge, forge_once), (one, one_once) = runs["forge"], runs["one process"]
    even = (forge_once - one_once) / (one - forge) if forge < one else math.inf
    say(f"  forge / one process: {forge / one:.3f} s/step; forge ahead {after(even)}")
    return {"ratio": forge / one, "even": even, "forge": forge, "one process": one}


def after(steps: float) -> str:
    return "never" if math.isinf(steps) else f"after {max(steps, 0):.0f} steps"


def main(args: argparse.Namespace, logs: Path) -> None:
    result = Result("single_process")
    for batch in args.sizes:
        overrides = [f"buffer.batch_size={batch}", "buffer.capacity=1024", *args.overrides]
        runs = [
            repeat(args.config, overrides, args.steps, forge_first=r % 2 == 1, logs=logs)
            for r in range(args.repeats)
        ]
        ratios = [r["ratio"] for r in runs]
        say(
            f"{batch} sequences per step: forge / one process, median of {len(runs)}: "
            f"{statistics.median(ratios):.3f} s/step (spread {min(ratios):.3f}..{max(ratios):.3f};"
            f" target <= 1); forge ahead {after(statistics.median(r['even'] for r in runs))}, its "
            "start-up included\n"
        )
        even = statistics.median(r["even"] for r in runs)
        for name in ("one process", "forge"):
            per = statistics.median(r[name] for r in runs)
            result.figure(f"{batch} sequences: {name}, median", per, "s/step")
        result.ratio(
            f"{batch} sequences: forge / one process s/step, median",
            statistics.median(ratios),
            target="<= 1",
            headline=batch == args.sizes[-1],
        )
        result.ratio(f"{batch} sequences: forge / one process s/step, min", min(ratios))
        result.ratio(f"{batch} sequences: forge / one process s/step, max", max(ratios))
        if not math.isinf(even):
            result.figure(f"{batch} sequences: forge ahead after", max(even, 0), "steps")
    result.write()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo/smollm2_cpu.yaml")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    # One run in this process, for `measure` in the parent.
    parser.add_argument("--run", choices=["forge", "one process"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        asyncio.run(one_run(args))
    else:
        main(args, library_output_to_log("single_process").parent)
