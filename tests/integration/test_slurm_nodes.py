"""Two SLURM nodes for real: partition `two` of the test cluster (`.ci/slurm.sh`) is two network
namespaces on this machine, forge-node1 and forge-node2, each with its own hostname, address
and network stack, joined by a bridge. A tiny GRPO run submitted there puts its trainer on one
node and its generator on the other; the weights cross between the two addresses over
torchstore.

Skipped where the partition is not up (a machine that refuses network namespaces); CI sets
FORGE_NO_SKIPS, so there the skip fails the run.
"""

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from helper_runs import forge_run, metrics, trained
from helper_slurm import (
    TINY,
    free_port,
    job_processes,
    no_slurm_reason,
    submit_grpo,
    submitted,
    wait_job_done,
    wait_until,
)

PARTITION = "two"
_SKIP = no_slurm_reason(PARTITION)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP)),
]
STEPS = 3
# The trainer and the generator each ask for the 2 cores of a host: hosts are filled first-fit,
# so each role gets a host of its own.
TWO_HOSTS = (
    "mode=sync",
    f"steps={STEPS}",
    "export_hf=false",
    "weight_sync.transport.kind=torchstore",
    "generator_resources.cpus_per_proc=2",
    "trainer_resources.cpus_per_proc=2",
    "provisioner.cpus_per_host=2",
    "generator_resources.env={FORGE_TEST_ROLE: generator}",
    "trainer_resources.env={FORGE_TEST_ROLE: trainer}",
)


def test_the_nodes_are_two_hosts_with_their_own_names_addresses_and_network():
    script = 'echo "$(hostname) $SLURMD_NODENAME $(readlink /proc/self/ns/net)"'
    out = subprocess.run(
        ["srun", "-p", PARTITION, "-N2", "-n2", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    nodes = sorted(line.split() for line in out.stdout.splitlines())
    assert [n[0] for n in nodes] == [n[1] for n in nodes] == ["forge-node1", "forge-node2"]
    networks = {n[2] for n in nodes}
    assert len(networks) == 2 and os.readlink("/proc/self/ns/net") not in networks
    addresses = {socket.gethostbyname(n[0]) for n in nodes}
    assert len(addresses) == 2 and not any(a.startswith("127.") for a in addresses), addresses


def test_a_run_over_both_nodes_trains_as_it_does_on_one(tmp_path):
    """The submitted run's trainer and generator run in the two nodes' namespaces (seen in the
    processes, and in placement.json); in sync mode its losses and gradient norms are those
    of the same run on two hosts the `process` launcher emulates on one node, bit for bit."""
    run_dir, one_node = tmp_path / "two-nodes", tmp_path / "one-node"
    reference = forge_run(
        "grpo",
        TINY,
        one_node,
        "reward.functions=[helper_rewards:vowel_fraction]",
        "provisioner.launcher=process",
        "provisioner.hosts=2",
        *TWO_HOSTS,
    )
    try:
        out = submit_grpo(run_dir, free_port(), "--nodes=2", *TWO_HOSTS, partition=PARTITION)
        job, log = submitted(out, run_dir)
        try:
            wait_until(lambda: _roles_running(job), "trainer and generator running", log)
            networks = {role: _networks(job, role) for role in ("trainer", "generator")}
            wait_job_done(job, log)
        finally:
            subprocess.run(["scancel", job])
        assert reference.wait(timeout=600) == 0
    finally:
        if reference.poll() is None:
            reference.kill()

    placement = json.loads((run_dir / "placement.json").read_text())
    hosts = {m["mesh"]: m["hosts"] for m in placement}
    (trainer_node,), (generator_node,) = hosts["TitanTrainer"], hosts["Generator"]
    assert {trainer_node, generator_node} == {"forge-node1", "forge-node2"}
    assert networks == {
        "trainer": {_namespace(trainer_node)},
        "generator": {_namespace(generator_node)},
    }
    # Each step trained on episodes of the version before: the weights crossed every step.
    assert [r["policy_versions"] for r in trained(run_dir)] == [[v] * 8 for v in range(STEPS)]
    # Bit for bit: the trainer took the same batches from the same weights.
    assert _figures(run_dir, "train/loss") == _figures(one_node, "train/loss")
    assert _figures(run_dir, "train/grad_norm") == _figures(one_node, "train/grad_norm")
    # Summed in the order episodes finished: the same rewards, up to rounding.
    reward = _figures(one_node, "rollout/reward")
    assert _figures(run_dir, "rollout/reward") == pytest.approx(reward, rel=1e-12)


def _figures(run_dir: Path, key: str) -> list[float]:
    return [m[key] for m in metrics(run_dir)]


def _roles_running(job: str) -> bool:
    return all(job_processes(job, FORGE_TEST_ROLE=role) for role in ("trainer", "generator"))


def _networks(job: str, role: str) -> set[int]:
    """The network namespaces (inode numbers) the role's processes run in."""
    found = set()
    for pid in job_processes(job, FORGE_TEST_ROLE=role):
        try:
            found.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
        except FileNotFoundError:
            pass  # ended meanwhile
    return found


def _namespace(node: str) -> int:
    return os.stat(f"/run/netns/{node}").st_ino
