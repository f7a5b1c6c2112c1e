"""Where the trainer's FLOP rate stops: the model's matrix products alone, its forward and
backward passes, and a training step, each against a square matmul on the same cores.

The trainer's FLOP rate (6 x parameters x tokens / time) is read as a fraction of a 2048^3
float32 matmul, the fastest work these cores do. This bench takes apart what lies between the
two, on GRPO-shaped micro-batches of SmolLM2-135M (8 sequences of a 48-token prompt and 32
sampled tokens), in this process on `torch.get_num_threads()` threads:

1. products: the matrix products of one micro-batch's forward and backward passes (three per
   linear layer; the lm_head's over the sampled positions only, as the trainer computes it),
   one after another with nothing between them;
2. forward + backward: the model's passes over one micro-batch as the trainer runs them
   (`token_logprobs`), with the elementwise work, attention and the logits between products;
3. step: two micro-batches, gradient clipping and the AdamW step.

Each figure is the best of `--repeats`, beside a matmul measured just before it (this machine's
speed drifts). Printed: 6 x parameters x tokens / time as a fraction of the matmul for each,
and for the products also their own FLOPs' rate.

    python bench/trainer_flops.py [--repeats 3]
"""

import argparse
import time
from collections.abc import Callable

import torch
from library_log import library_output_to_log
from result import Result
from trainer_memory import matmul_flops

from forge.models import smollm2
from forge.models.titan import load_pretrained, token_logprobs
from forge.observability.console import say

SEQUENCES, PROMPT, SAMPLED = 8, 48, 32


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocations, thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def products(model: torch.nn.Module, tokens: int, sampled: int) -> tuple[Callable[[], None], int]:
    """The micro-batch's matrix products as one function, and their FLOPs."""
    lm_head = model.lm_head.weight.detach()
    linears = [
        m.weight.detach()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not model.lm_head
    ]
    work = [(w, torch.randn(tokens, w.shape[1]), torch.randn(tokens, w.shape[0])) for w in linears]
    work.append(
        (lm_head, torch.randn(sampled, lm_head.shape[1]), torch.randn(sampled, lm_head.shape[0]))
    )

    def run() -> None:
        for weight, x, grad_y in work:
            x @ weight.T  # forward
            grad_y @ weight  # gradient of the input
            grad_y.T @ x  # gradient of the weight

    return run, sum(6 * x.shape[0] * w.numel() for w, x, _ in work)


def fixed_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[Callable[[], None], int]:
    """A training step of fixed shape: two GRPO-shaped micro-batches, gradient clipping and
    the optimizer; the function and the tokens it trains on."""
    ids = torch.randint(model.lm_head.weight.shape[0], (SEQUENCES, PROMPT + SAMPLED))

    def step() -> None:
        for _ in range(2):
            (-token_logprobs(model, ids, 1.0, 512, PROMPT).sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step, 2 * ids.numel()


def fixed_step_seconds(repeats: int = 3) -> tuple[float, int]:
    """The fixed-shape step's best time on SmolLM2 in this process, and the tokens it trains."""
    model = load_pretrained(smollm2()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    step, tokens = fixed_step(model, optimizer)
    return best_time(step, repeats), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = load_pretrained(smollm2()).train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(model.lm_head.weight.shape[0], (SEQUENCES, PROMPT + SAMPLED))
    tokens = ids.numel()
    product_run, product_flops = products(model, tokens, SEQUENCES * SAMPLED)

    def forward_backward() -> None:
        (-token_logprobs(model, ids, 1.0, 512, PROMPT).sum()).backward()

    step, _ = fixed_step(model, optimizer)

    say(
        f"SmolLM2-135M ({params / 1e6:.1f}M parameters), {torch.get_num_threads()} threads, "
        f"micro-batch {SEQUENCES} x ({PROMPT} + {SAMPLED}) tokens"
    )
    result = Result("trainer_flops")
    for name, fn, count in [
        ("products", product_run, tokens),
        ("forward + backward", forward_backward, tokens),
        ("step", step, 2 * tokens),
    ]:
        matmul = matmul_flops()
        seconds = best_time(fn, args.repeats)
        optimizer.zero_grad()
        own = (
            f"; their own FLOPs at {product_flops / seconds / matmul:.2f}"
            if fn is product_run
            else ""
        )
        fraction = 6 * params * count / seconds / matmul
        say(
            f"{name:>18}: {seconds:.3f} s, 6 x parameters x tokens / time = "
            f"{fraction:.2f} of the matmul ({matmul / 1e9:.0f} GFLOP/s){own}"
        )
        result.figure(f"{name}: time", seconds, "s")
        result.figure(f"{name}: matmul measured before it", matmul / 1e9, "GFLOP/s")
        result.ratio(f"{name}: 6 x parameters x tokens / time / matmul rate", fraction)
        if fn is product_run:
            result.ratio(
                "products: their own FLOPs / time / matmul rate", product_flops / seconds / matmul
            )
    result.write()


if __name__ == "__main__":
    library_output_to_log("trainer_flops")
    main()
