"""A run over two hosts: the `process` launcher emulates them on this machine (each host its own
Monarch host agent), weights cross between them over Monarch RDMA buffers (the `rdma`
transport: Monarch's TCP fallback here, torchstore holding manifests and handles). Where each
role landed is observed in the running processes, not taken from the config. (The same run
submitted to SLURM with `forge submit` is in tests/integration/test_slurm.py.)"""

import json

import psutil
import pytest
from helper_runs import finish, forge_run, metrics, processes_with_env, trained, wait_for_steps

pytestmark = pytest.mark.integration

TINY = "configs/grpo/tiny_cpu.yaml"
STEPS = 3


def test_generator_and_trainer_on_two_hosts_exchange_weights_over_rdma(tmp_path):
    run_dir = tmp_path / "two-hosts"
    proc = forge_run(
        "grpo",
        TINY,
        run_dir,
        "reward.functions=[helper_rewards:vowel_fraction]",
        f"steps={STEPS}",
        "export_hf=false",
        "provisioner.launcher=process",
        "provisioner.hosts=2",
        "weight_sync.transport.kind=rdma",  # one transport: the trainer's and the generators'
        # Hosts are filled first-fit: a role that takes all of a host's cores leaves the
        # next role the other host. Emulated hosts share this machine's cores.
        "generator_resources.cpus_per_proc=2",
        "trainer_resources.cpus_per_proc=2",
        "provisioner.cpus_per_host=2",
        "generator_resources.env={FORGE_TEST_ROLE: generator}",
        "trainer_resources.env={FORGE_TEST_ROLE: trainer}",
    )
    try:
        wait_for_steps(proc, run_dir, 1)
        agents = {r: _host_agents(proc.pid, r) for r in ("generator", "trainer")}
        finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(agents["generator"]) == len(agents["trainer"]) == 1, agents
    assert agents["generator"] != agents["trainer"], agents
    # The run's own record says the same.
    placement = {
        m["mesh"]: m["hosts"] for m in json.loads((run_dir / "placement.json").read_text())
    }
    assert placement["Generator"] != placement["TitanTrainer"], placement
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, STEPS + 1))
    assert len(trained(run_dir)) == STEPS


def _host_agents(driver: int, role: str) -> set[int]:
    """The host agents that spawned the role's procs: a proc's parent is the agent of its host,
    one agent process per emulated host, started by the driver. (The role's env marks its
    procs and what they start, such as vLLM's engine core: only the top ones count.)"""
    pids = set(processes_with_env(driver, "FORGE_TEST_ROLE", role))
    agents = {psutil.Process(p).ppid() for p in pids} - pids
    assert all(psutil.Process(a).ppid() == driver for a in agents), agents
    return agents
