"""What the teacher costs: student tokens trained per second in distillation vs GRPO.

Runs, in this process and one after the other, GRPO and then on-policy distillation once per
teacher backend (torchtitan forward, vLLM prompt logprobs), all on the same student model,
batch, placement and number of steps (the distillation config's). Trained tokens per second
= tokens the trainer stepped on / wall seconds, the first step (start-up) left out. GRPO pays
for rewards; distillation for the teacher's forward pass instead: the ratio shows how much of
the loop's throughput the teacher takes.

    python bench/distill_throughput.py [--config configs/distillation/pruned_student_cpu.yaml]
                                       [--steps 6] [k=v ...]
"""

import argparse
import asyncio
import json
from pathlib import Path

from library_log import library_output_to_log
from result import Result
from scratch import scratch_folder

from forge.cli import load_app
from forge.config import load_config
from forge.observability.console import say

APPS = Path(__file__).parents[1] / "apps"
GRPO_CONFIG = "configs/grpo/smollm2_cpu.yaml"
# Keys both apps understand, copied from the distillation config into the GRPO run.
SHARED = ("group_size", "data", "buffer", "generator_resources", "trainer_resources")


async def run(app: str, config: str, overrides: list[str]) -> list[dict]:
    app_main, schema = load_app(APPS / app / "main.py")
    run_dir = scratch_folder(app)
    cfg = load_config(schema, config, [*overrides, f"run_dir={run_dir}"])
    say(f"{app} run ({' '.join(overrides)}) -> {run_dir}")
    await app_main(cfg)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tokens_per_s(steps: list[dict]) -> float:
    """Trained tokens per wall second, from the end of step 1 to the end of the last."""
    tokens = sum(s["train/tokens"] for s in steps[1:])
    return tokens / (steps[-1]["run/elapsed_s"] - steps[0]["run/elapsed_s"])


async def main(args: argparse.Namespace) -> None:
    _, schema = load_app(APPS / "distillation" / "main.py")
    distill = load_config(schema, args.config, args.overrides)
    student = str(distill.student.path()) if distill.student else distill.trainer.model
    common = [
        f"steps={args.steps}",
        "export_hf=false",
        "eval.interval=0",
        "trainer.checkpoint.enabled=false",
        *args.overrides,
    ]
    shared = [f"{key}={json.dumps(_plain(getattr(distill, key)))}" for key in SHARED]
    grpo = await run(
        "grpo",
        GRPO_CONFIG,
        [*common, *shared, f"generator.model={student}", f"trainer.model={student}"],
    )
    results = {"grpo": tokens_per_s(grpo)}
    result = Result("distill_throughput")
    for backend in ("titan", "vllm"):
        steps = await run("distillation", args.config, [*common, f"teacher.backend={backend}"])
        results[f"distill ({backend} teacher)"] = tokens_per_s(steps)
        teacher = sum(s["teacher/tokens_per_s"] for s in steps[1:]) / (len(steps) - 1)
        say(f"  teacher {backend}: {teacher:.0f} tokens/s scored per call")
        result.figure(f"teacher ({backend}) scored per call", teacher, "tokens/s")
    say(f"student model {student}, {args.steps} steps each, tokens trained per second:")
    for name, rate in results.items():
        say(f"  {name:26s} {rate:8.1f} tokens/s = {rate / results['grpo']:.3f} of GRPO's")
        result.figure(f"{name}: trained", rate, "tokens/s")
        if name != "grpo":
            result.ratio(f"{name} / GRPO tokens trained per second", rate / results["grpo"])
    result.write()


def _plain(value: object) -> object:
    """A config value as plain data, for a key=value override, without the fields the config
    derives (a section's RENAMED_KEYS that are fields), which an override may not set."""
    from dataclasses import asdict, is_dataclass

    if not is_dataclass(value):
        return value
    derived = getattr(value, "RENAMED_KEYS", {})
    return {k: v for k, v in asdict(value).items() if k not in derived}


if __name__ == "__main__":
    library_output_to_log("distill_throughput")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/distillation/pruned_student_cpu.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    asyncio.run(main(parser.parse_args()))
