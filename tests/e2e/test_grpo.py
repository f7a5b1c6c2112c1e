"""The GRPO app end to end, through `python -m forge run`, on real processes and vLLM.

Tiny-model runs check the machinery (sync == async at max_policy_age 0, surviving a killed
generator); the SmolLM2 run checks that GRPO learns.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
VOWELS = "reward.functions=[helper_rewards:vowel_fraction]"


def forge_run(config: str, run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "forge",
        "run",
        "apps/grpo/main.py",
        "--config",
        config,
        f"run_dir={run_dir}",
        *overrides,
    ]
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 900) -> None:
    code = proc.wait(timeout=timeout)
    log = (run_dir.parent / f"{run_dir.name}.log").read_text()
    assert code == 0, log[-4000:]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trained(run_dir: Path) -> list[dict]:
    lines = (run_dir / "trained_episodes.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_async_grpo_learns_on_smollm2(tmp_path):
    """SmolLM2-135M learns, in async mode, to answer in at most 8 words.

    Baseline, measured: 41% of the base model's sampled answers are that short (step 1). A
    16-sample step mean near 0.5 has a standard deviation of ~0.125, so the difference of two
    3-step means has ~0.1: the threshold, last 3 steps above the first 3 by 0.2, is twice that.
    A run measured 0.41 -> 1.0 over 12 steps (first 3: 0.55, last 3: 0.90).
    """
    run_dir = tmp_path / "learn"
    config = yaml.safe_load((ROOT / "configs/grpo/smollm2_cpu.yaml").read_text())
    config["reward"] = {"functions": ["helper_rewards:brevity"]}
    (tmp_path / "learn.yaml").write_text(yaml.safe_dump(config))
    overrides = ("steps=12", "trainer.optimizer.lr=2e-5", "trainer.checkpoint.folder=null")
    finish(forge_run(str(tmp_path / "learn.yaml"), run_dir, *overrides), run_dir)
    steps = metrics(run_dir)
    rewards = [m["rollout/reward"] for m in steps]
    print(f"brevity reward per step: {[round(r, 2) for r in rewards]}")
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2
    assert all(m["train/mismatch_kl"] < 1e-3 for m in steps)
    for record in trained(run_dir):
        ages = [record["trainer_version"] - v for v in record["policy_versions"]]
        assert max(ages) <= 1, record


def test_sync_mode_and_async_at_age_zero_train_on_the_same_data(tmp_path):
    runs = {}
    for mode in ("sync", "async"):
        run_dir = tmp_path / mode
        finish(
            forge_run(
                "configs/grpo/tiny_cpu.yaml",
                run_dir,
                VOWELS,
                f"mode={mode}",
                "steps=3",
                "buffer.max_policy_age=0",
            ),
            run_dir,
        )
        runs[mode] = run_dir
    sync, asynchronous = (trained(runs[m]) for m in ("sync", "async"))
    assert [s["episodes"] for s in sync] == [a["episodes"] for a in asynchronous]
    for key in ("train/loss", "train/grad_norm"):
        sync_values, async_values = ([m[key] for m in metrics(runs[mode])] for mode in runs)
        assert sync_values == pytest.approx(async_values, rel=1e-5, abs=1e-6), key
    # Fresh data gives ratio 1 and group-normalised advantages average to ~0, so the loss value
    # is ~0 in both modes; the gradient shows that the step really trained on something.
    assert min(m["train/grad_norm"] for m in metrics(runs["sync"])) > 1e-3


def test_a_killed_generator_replica_is_replaced_and_no_episode_is_lost(tmp_path):
    run_dir = tmp_path / "kill"
    proc = forge_run(
        "configs/grpo/tiny_cpu.yaml",
        run_dir,
        VOWELS,
        "steps=40",
        "generator_resources.num_replicas=2",
    )
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(metrics(run_dir)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "run ended early"
            time.sleep(0.5)
        victim = _generator_processes(proc.pid)[0]
        os.kill(victim, signal.SIGKILL)
        finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = metrics(run_dir)
    assert max(m.get("generator/deaths", 0) for m in steps) >= 1
    assert max(m.get("generator/recoveries", 0) for m in steps) >= 1
    assert not any(m.get("rollout/failed_groups") for m in steps)
    ids = [e for s in trained(run_dir) for e in s["episodes"]]
    assert len(ids) == len(set(ids)) == 40 * 8  # nothing trained twice, every step full
    groups: dict[str, int] = {}
    for episode in ids:
        group = episode.split("-")[0]
        groups[group] = groups.get(group, 0) + 1
    # A group's samples can carry different versions (a drain lets queued samples start on the
    # new weights), so one can go stale alone: it is evicted and counted, never silently lost.
    # Only the last batch may hold part of a group whose rest was still buffered.
    last_batch = {e.split("-")[0] for e in trained(run_dir)[-1]["episodes"]}
    missing = sum(4 - n for g, n in groups.items() if g not in last_batch)
    assert max(groups.values()) == 4
    assert missing <= max(m.get("buffer/evicted_stale", 0) for m in steps)
    for record in trained(run_dir):  # bounded staleness, by construction
        ages = [record["trainer_version"] - v for v in record["policy_versions"]]
        assert 0 <= min(ages) and max(ages) <= 1, record
    # Generator vs trainer logprobs of the same tokens under the same weights, every step.
    assert all(m["train/mismatch_kl"] < 1e-3 for m in steps)


def _generator_processes(driver: int) -> list[int]:
    """Generator actor processes: the parents of vLLM engine processes under the driver."""
    found = []
    for p in psutil.Process(driver).children(recursive=True):
        if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
            found.append(p.ppid())
    assert len(found) == 2, found
    return found


def test_ctrl_c_writes_a_final_checkpoint_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "interrupted"
    proc = forge_run(
        "configs/grpo/tiny_cpu.yaml",
        run_dir,
        VOWELS,
        "steps=1000",
        f"trainer.checkpoint.folder={tmp_path / 'ckpt'}",
    )
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(metrics(run_dir)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "run ended early"
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "ckpt" / "latest").exists()
    assert (run_dir / "metrics.png").exists()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
