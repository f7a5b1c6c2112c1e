"""GRPO on one CUDA GPU: the tiny config for a few steps, generator and trainer colocated on
the device (without vLLM's sleep mode: vLLM keeps 0.3 of the memory), both in bfloat16, the
trainer on NCCL (what it picks wherever CUDA is available).

The smoke test is marked `gpu`: where torch sees no GPU it is skipped with the reason
(tests/helper_skips.py), and CI's skip guard lets it. Its overrides are loaded through the
config loader on every machine, so a typo in them fails here and not first on a GPU machine.
"""

import math
import os
from pathlib import Path

import pytest
from helper_runs import finish, forge_run, metrics

from forge.cli import load_app
from forge.config import load_config
from forge.loop.plan import plan_run
from forge.placement.plan import ClusterShape

ROOT = Path(__file__).parents[2]
TINY = "configs/grpo/tiny_cpu.yaml"
STEPS = 4
OVERRIDES = (
    f"steps={STEPS}",
    "export_hf=false",
    # Varies across a random model's samples, so every step has a gradient to apply.
    "reward.functions=[helper_rewards:vowel_fraction]",
    # Colocated: generator and trainer share the device group (here the trainer's one GPU),
    # each process seeing it as its CUDA_VISIBLE_DEVICES, taking turns.
    "placement=colocated",
    "generator_resources.with_gpus=true",
    "trainer_resources.with_gpus=true",
    "weight_sync.dtype=bfloat16",
    "trainer.dtype=bfloat16",
    # vLLM refuses to start unless this share of the device is free; the rest is the trainer's.
    "generator.gpu_memory_utilization=0.3",
)


def test_smoke_overrides_load_onto_the_grpo_config():
    schema = load_app(ROOT / "apps" / "grpo" / "main.py")[1]
    cfg = load_config(schema, ROOT / TINY, ["run_dir=runs/gpu-smoke", *OVERRIDES])
    assert cfg.steps == STEPS and cfg.placement == "colocated"
    assert (cfg.weight_sync.dtype, cfg.trainer.dtype) == ("bfloat16", "bfloat16")
    assert cfg.generator.gpu_memory_utilization == 0.3
    assert cfg.reward.functions == ["helper_rewards:vowel_fraction"]
    plan = plan_run(cfg, ClusterShape(hosts=1, gpus_per_host=1, cpus_per_host=2))
    # The check Run.start makes first: both on the one GPU, each process fenced to it.
    assert plan.of_role("trainer")[0].gpus == plan.of_role("generator")[0].gpus == ((0,),)


@pytest.mark.gpu
@pytest.mark.integration
def test_tiny_grpo_on_one_shared_gpu(tmp_path, monkeypatch):
    # Every process of the run inherits this: on a machine with several GPUs, all share one.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    run_dir = tmp_path / "gpu-smoke"
    # Under pytest's 600 s timeout, so a hung run fails with its logs.
    finish(forge_run("grpo", TINY, run_dir, *OVERRIDES), run_dir, timeout=540)
    steps = metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(s["train/loss"]) for s in steps), steps
    assert all(math.isfinite(s["train/grad_norm"]) for s in steps), steps
    assert max(s["train/grad_norm"] for s in steps) > 0
