"""Shared memory and processes are given back.

A run leaves nothing of its own in /dev/shm, whether it ends normally or is SIGKILLed (its whole
process group) and followed by `forge clean`; the two tiny runs go at once. What is "ours" is
taken from the running processes themselves: every /dev/shm path a process of the run maps,
plus the run's own folder, found mid-run so the test could fail. A run stopped by Ctrl-C is
tests/e2e/test_grpo.py's killed-generator run, which checks the same. A generator fed through
torchstore stages versions in a shared-memory folder of its own, and `shutdown()` removes it
and stops torchstore's processes.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helper_runs import ROOT, finish, forge_run, shm_mapped, wait_for_steps
from safetensors.torch import load_file

from forge.actors.generator import Generator, GeneratorConfig
from forge.controller import shutdown
from forge.models import tiny_model
from forge.weights import torchstore_compat
from forge.weights.shm_folders import SHM_ROOT, folder_bytes, owner_of, run_folder
from forge.weights.sync_config import WeightSyncConfig
from forge.weights.torchstore_transport import TorchStoreTransport
from forge.weights.transport import TransportConfig

pytestmark = pytest.mark.integration

TINY = "configs/grpo/tiny_cpu.yaml"
VOWELS = "reward.functions=[helper_rewards:vowel_fraction]"


def start(run_dir: Path, steps: int) -> subprocess.Popen:
    """A tiny GRPO run in a session of its own, so that its whole process group can be
    killed."""
    return forge_run("grpo", TINY, run_dir, VOWELS, f"steps={steps}", "export_hf=false")


def shm_bytes() -> int:
    return sum(f.stat().st_size for f in SHM_ROOT.rglob("*") if f.is_file() and not f.is_symlink())


def test_a_run_gives_its_shared_memory_back_however_it_ends(tmp_path):
    before = shm_bytes()
    runs = {how: tmp_path / how for how in ("normal", "killed")}
    procs = {how: start(run_dir, 4 if how == "normal" else 1000) for how, run_dir in runs.items()}
    seen: dict[str, set[Path]] = {}
    processes: list[psutil.Process] = []
    try:
        for how, run_dir in runs.items():
            wait_for_steps(procs[how], run_dir, 1)  # a weight version is in shared memory
            folder = run_folder(run_dir)
            assert folder_bytes(folder) > 0, f"{how}: {folder} holds no weights mid-run"
            mapped, tree = shm_mapped(procs[how].pid)
            seen[how] = mapped | {folder}
            processes += tree
            print(f"{how}: {folder_bytes(folder) / 1e6:.1f} MB in {folder}; maps {sorted(mapped)}")
        os.killpg(procs["killed"].pid, signal.SIGKILL)
        finish(procs["normal"], runs["normal"])
        assert procs["killed"].wait(timeout=60) == -signal.SIGKILL
        _, alive = psutil.wait_procs(processes, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
        # SIGKILL left the killed run's folder: `forge clean` removes it, unless a run that
        # another test worker starts meanwhile has done so first (a run's start cleans up after
        # dead runs too; tests/unit/test_weights.py checks both on folders of their own).
        leftover = run_folder(runs["killed"])
        clean = subprocess.run(
            [sys.executable, "-m", "forge", "clean"], cwd=ROOT, capture_output=True, text=True
        )
        assert clean.returncode == 0 and "folders of dead processes removed" in clean.stdout
        assert not leftover.exists(), clean.stdout
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for p in processes:
            if p.is_running():
                p.kill()
    left = {how: sorted(p for p in paths if p.exists()) for how, paths in seen.items()}
    print(f"/dev/shm: {before / 1e6:.1f} MB before, {shm_bytes() / 1e6:.1f} MB after")
    assert left == {how: [] for how in runs}


async def test_torchstore_staging_and_storage_processes_are_given_back():
    before = set(psutil.Process().children(recursive=True))
    await torchstore_compat.initialize()
    model = tiny_model("llama", seed=0)
    transport = TransportConfig(kind="torchstore", path="given-back", fetch_timeout_s=30.0)
    cfg = GeneratorConfig(model=str(model), max_model_len=256, kv_cache_mb=32)
    try:
        generator = await Generator.options(env={"OMP_NUM_THREADS": "1"}).as_actor(
            cfg, WeightSyncConfig(transport)
        )
        weights = load_file(model / "model.safetensors")
        weights["model.embed_tokens.weight"] += 1.0  # not the weights the engine started with
        manifest = await TorchStoreTransport("given-back").publish(1, weights)
        await generator.update_weights.call_one(1)
        embed = next(e for e in manifest.tensors if e.name == "model.embed_tokens.weight")
        assert await generator.loaded_checksum.call_one(embed.name) == embed.checksum
        started = set(psutil.Process().children(recursive=True)) - before
        staging = [
            f
            for f in SHM_ROOT.glob("forge-staging-*")
            if (owner := owner_of(f)) and owner.pid in {p.pid for p in started}
        ]
        assert len(staging) == 1 and folder_bytes(staging[0]) > 0  # the spare file
    finally:
        await shutdown()
    _, alive = psutil.wait_procs(started, timeout=60)
    assert not alive, [p.cmdline() for p in alive]  # the storage volume's process included
    assert not staging[0].exists()
