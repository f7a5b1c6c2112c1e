"""Tinker API overhead: a training step and sampling through the `tinker` SDK and `forge serve`,
against the same work on forge's trainer and generator called directly.

Two models of one spec (LoRA rank 8 on `--model`) are started: one by `forge serve` (a
subprocess, driven over HTTP by the SDK), one in this process by the same code the server uses
(forge.serve.tinker.tenants.Tenant: its own TitanTrainer and Generator). The two are timed in
alternation, `--rounds` times, on the same batch: a `forward_backward` (cross-entropy, `--batch`
sequences of `--length` tokens) then an `optim_step`; and sampling `--samples` sequences of
`--tokens` tokens from one prompt. Only one side works at a time. Recorded: the median seconds
of each, and SDK / direct for the step (target <= 1.15) and direct / SDK for the sampled
tokens/s (i.e. SDK tokens/s over direct, target >= 0.9).

    python bench/tinker_overhead.py [--model SmolLM2-135M-Instruct] [--rounds 10]
"""

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from library_log import library_output_to_log
from result import ROOT, Result
from scratch import scratch_folder

from forge.actors.trainer.client_steps import AdamStep, TokenDatum
from forge.config import load_config
from forge.controller import shutdown
from forge.observability.console import say
from forge.serve.tinker.config import ServeConfig
from forge.serve.tinker.futures import Futures
from forge.serve.tinker.tenants import ModelSpec, Tenant
from forge.weights.shm_folders import ShmFolder

CONFIG = ROOT / "configs" / "serve" / "tiny_cpu.yaml"
KEY = "tml-forge-bench-key"


def start_server(state_dir: Path, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "forge", "serve", "--config", str(CONFIG),
         f"state_dir={state_dir}", "port=0", *overrides],
        cwd=ROOT, env={**os.environ, "TINKER_API_KEY": KEY},
    )  # fmt: skip
    address = state_dir / "serve.json"
    while not address.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"forge serve exited with {proc.returncode}")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{json.loads(address.read_text())['port']}"


def batch(args: argparse.Namespace) -> list[list[int]]:
    return [[(7 * i + j) % 5000 + 10 for j in range(args.length + 1)] for i in range(args.batch)]


async def main(args: argparse.Namespace) -> None:
    import tinker
    from tinker import types

    folder = scratch_folder("tinker_overhead")
    overrides = [f"base_models=[{args.model}]", "max_models=1"]
    cfg = load_config(ServeConfig, CONFIG, [*overrides, f"state_dir={folder / 'direct'}"])
    proc, url = start_server(folder / "served", overrides)
    spec = ModelSpec(base_model=args.model, rank=8)
    shm = ShmFolder.create(f"bench-tinker-{os.getpid()}", "bench/tinker_overhead.py")
    direct = await Tenant.start("direct", spec, cfg, Futures(), shm.path)
    try:
        os.environ["TINKER_TELEMETRY"] = "0"
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        served = client.create_lora_training_client(base_model=args.model, rank=8).result()
        sequences = batch(args)
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(s[:-1]),
                loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * args.length},
            )
            for s in sequences
        ]
        mine = [TokenDatum(s[:-1], {"target_tokens": s[1:], "weights": [1.0] * args.length})
                for s in sequences]  # fmt: skip
        adam = AdamStep(learning_rate=1e-4)

        def sdk_step() -> None:
            step = served.forward_backward(data, "cross_entropy")
            served.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            step.result()

        async def direct_step() -> None:
            await direct.trainer.forward_backward.call_one([mine], "cross_entropy", {}, True)
            await direct.trainer.optim_step.call_one(adam)

        sampler = served.save_weights_and_get_sampling_client().result()
        await direct.save_for_sampler()
        prompt = sequences[0][:16]
        # No stop: every sequence is max_tokens long, as on the direct side.
        params = types.SamplingParams(max_tokens=args.tokens, seed=0, stop=[])
        sampling = {"max_tokens": args.tokens, "seed": 0, "ignore_eos": True}

        def sdk_sample() -> int:
            out = sampler.sample(types.ModelInput.from_ints(prompt), args.samples, params)
            return sum(len(s.tokens) for s in out.result().sequences)

        async def direct_sample() -> int:
            out = await direct.generator.generate.route(prompt, n=args.samples, sampling=sampling)
            return sum(len(c.token_ids) for c in out)

        times: dict[str, list[float]] = {"sdk": [], "direct": []}
        rates: dict[str, list[float]] = {"sdk": [], "direct": []}
        for _ in range(args.rounds + 1):  # the first round warms both up and is dropped
            start = time.perf_counter()
            await asyncio.to_thread(sdk_step)
            times["sdk"].append(time.perf_counter() - start)
            start = time.perf_counter()
            await direct_step()
            times["direct"].append(time.perf_counter() - start)
            start = time.perf_counter()
            tokens = await asyncio.to_thread(sdk_sample)
            rates["sdk"].append(tokens / (time.perf_counter() - start))
            start = time.perf_counter()
            tokens = await direct_sample()
            rates["direct"].append(tokens / (time.perf_counter() - start))
    finally:
        await direct.close()
        await shutdown()
        shm.remove()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    step = {k: statistics.median(v[1:]) for k, v in times.items()}
    rate = {k: statistics.median(v[1:]) for k, v in rates.items()}
    result = Result("tinker_overhead")
    result.figure("step through the SDK (median)", step["sdk"], "s")
    result.figure("step on the trainer directly (median)", step["direct"], "s")
    result.figure("sampled tokens/s through the SDK (median)", rate["sdk"], "tokens/s")
    result.figure("sampled tokens/s on the generator directly (median)", rate["direct"], "tokens/s")
    result.ratio("step: SDK / direct", step["sdk"] / step["direct"], target="<= 1.15")
    result.ratio("sampling tokens/s: SDK / direct", rate["sdk"] / rate["direct"], target=">= 0.9")
    say(
        f"tinker_overhead: step {step['sdk']:.3f} s via SDK, {step['direct']:.3f} s direct "
        f"({step['sdk'] / step['direct']:.3f}x); sampling {rate['sdk']:.0f} vs "
        f"{rate['direct']:.0f} tokens/s ({rate['sdk'] / rate['direct']:.3f}x)"
    )
    result.write()


if __name__ == "__main__":
    library_output_to_log("tinker_overhead")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="sequences a step")
    parser.add_argument("--length", type=int, default=128, help="tokens a sequence")
    parser.add_argument("--samples", type=int, default=8, help="sequences sampled a round")
    parser.add_argument("--tokens", type=int, default=64, help="tokens a sampled sequence")
    asyncio.run(main(parser.parse_args()))
