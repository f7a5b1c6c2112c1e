"""A run starts the roles its config lists and no other: SFT with its eval off starts neither a
generator (nor its vLLM engine) nor a reward service, only its trainer. Tiny model, real
processes."""

import json
import signal

import psutil
import pytest
from helper_runs import forge_run, processes_of, processes_with_env, wait_for_steps

pytestmark = pytest.mark.integration

TRAINER = "trainer_resources.env={FORGE_TEST_ROLE: trainer}"


def test_sft_with_eval_off_starts_no_generator_and_no_reward_service(tmp_path):
    run_dir = tmp_path / "sft"
    proc = forge_run(
        "sft", "configs/sft/tiny_cpu.yaml", run_dir, "eval.interval=0", "steps=1000", TRAINER
    )
    try:
        wait_for_steps(proc, run_dir, 2)  # every role started before step 1
        started = psutil.Process(proc.pid).children(recursive=True)
        trainer = processes_with_env(proc.pid, "FORGE_TEST_ROLE", "trainer")
        engines = processes_of(proc.pid, "EngineCore")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The driver's only process is the trainer's: no generator, engine or reward worker.
    assert [p.pid for p in started] == trainer and len(trainer) == 1
    assert not engines
    meshes = [m["mesh"] for m in json.loads((run_dir / "placement.json").read_text())]
    assert meshes == ["TitanTrainer"]
    gone, alive = psutil.wait_procs(started, timeout=30)
    assert not alive
