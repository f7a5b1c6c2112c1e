"""Two SLURM nodes for real: partition `two` of the test cluster (`.ci/slurm.sh`) is two network
namespaces on this machine, forge-node1 and forge-node2, each with its own hostname, address
and network stack, joined by a bridge. A tiny GRPO run submitted there puts its trainer on one
node and its generator on the other; the weights cross between the two addresses over
torchstore. Killing every process of a node loses it mid-run: the node of the trainer's second
rank, or of one of two generator replicas. A Jupyter
kernel outside the cluster's namespaces drives a run on both nodes interactively.

Skipped where the partition is not up (a machine that refuses network namespaces); CI sets
FORGE_NO_SKIPS, so there the skip fails the run.
"""

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import psutil
import pytest
from helper_runs import ROOT, forge_run, metrics, trained
from helper_slurm import (
    TINY,
    active_jobs,
    free_port,
    job_processes,
    no_slurm_reason,
    submit_grpo,
    submitted,
    tail,
    wait_job_done,
    wait_until,
)
from jupyter_client.manager import start_new_kernel

from forge.actors.trainer.checkpoint_folder import complete_steps, latest_step

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
    of the same run on two hosts the `process` launcher emulates on one node."""
    run_dir, one_node = tmp_path / "two-nodes", tmp_path / "one-node"
    reference = forge_run(
        "grpo",
        TINY,
        one_node,
        "reward.functions=[helper_rewards:vowel_fraction]",
        "provisioner.launcher=process",
        "provisioner.hosts=2",
        f"steps={STEPS}",
        *TWO_HOSTS,
    )
    try:
        out = submit_grpo(
            run_dir, free_port(), "--nodes=2", f"steps={STEPS}", *TWO_HOSTS, partition=PARTITION
        )
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
    # The trainer took the same batches from the same weights. The loss is near zero (the
    # advantages are normalized), and it holds the engine's logprobs, which vary in their last
    # bits with how the engine batched the requests (mismatch_kl ~1e-13): equal up to that.
    grad_norm = _figures(one_node, "train/grad_norm")
    assert _figures(run_dir, "train/grad_norm") == pytest.approx(grad_norm, rel=1e-6)
    assert _figures(run_dir, "train/loss") == pytest.approx(
        _figures(one_node, "train/loss"), abs=1e-7
    )
    # Summed in the order episodes finished: the same rewards, up to rounding.
    reward = _figures(one_node, "rollout/reward")
    assert _figures(run_dir, "rollout/reward") == pytest.approx(reward, rel=1e-12)


def test_a_lost_trainer_node_requeues_the_job_and_the_run_resumes_from_its_checkpoint(tmp_path):
    """The trainer spans both nodes (a rank on each), the generator beside its first rank.
    Every process of the second node is killed after step 3 (a checkpoint at step 2): the
    trainer's pending call finds its host lost by the provisioner's probe (Monarch would report
    its process dead minutes later), the driver names the node in one line and the job
    requeues itself; once the node is back, the same job resumes from the newest checkpoint
    and takes each step once, and no episode is trained twice."""
    run_dir, steps = tmp_path / "run", 8
    one_core_each = ("trainer_resources.cpus_per_proc=1", "generator_resources.cpus_per_proc=1")
    args = (f"steps={steps}", "trainer.checkpoint.interval=2", *TWO_HOSTS, *one_core_each)
    args += ("trainer_resources.hosts=2",)
    out = submit_grpo(run_dir, free_port(), "--nodes=2", *args, partition=PARTITION)
    job, log = submitted(out, run_dir)
    try:
        wait_until(lambda: len(_logged(run_dir)) >= 3, "three steps", log)
        placement = json.loads((run_dir / "placement.json").read_text())
        hosts = {m["mesh"]: m["hosts"] for m in placement}
        (node,) = set(hosts["TitanTrainer"]) - set(hosts["Generator"])
        _kill_node(node)
        wait_until(lambda: "forge: run failed" in log.read_text(), "the loss noticed", log, 60)
        (failed,) = [line for line in log.read_text().splitlines() if "run failed" in line]
        assert f"node {node} lost" in failed, failed
        # Nothing half-done: the newest checkpoint is whole and of a step that was logged.
        logged, newest = _logged(run_dir), latest_step(run_dir / "checkpoints")
        assert newest in complete_steps(run_dir / "checkpoints") and newest <= len(logged)
        assert logged == list(range(1, len(logged) + 1))
        subprocess.run(["bash", ".ci/slurm.sh"], cwd=ROOT, check=True, capture_output=True)
        wait_job_done(job, log)  # the same job: requeued, not submitted again
    finally:
        subprocess.run(["scancel", job])
    text = log.read_text()
    assert f"forge submit: job {job} requeued (1 of at most 3)" in text, tail(log)
    resumed_at = int(re.search(r"resuming at step (\d+)", text).group(1))
    assert 2 <= resumed_at < steps and latest_step(run_dir / "checkpoints") == steps
    assert _logged(run_dir) == list(range(1, steps + 1))
    ids = [e for r in trained(run_dir) for e in r["episodes"]]
    assert len(ids) == len(set(ids)) == steps * 8  # no episode trained twice, none lost


def test_a_lost_node_of_one_generator_replica_leaves_the_run_going_on_the_other(tmp_path):
    """Two generator replicas, one per node, the trainer beside the first: the second's node
    is lost mid-run. The run says so in one line and finishes on the remaining replica, in
    the same job, with no requeue."""
    run_dir, steps = tmp_path / "run", 6
    args = (
        f"steps={steps}",
        *TWO_HOSTS,
        "generator_resources.num_replicas=2",
        "trainer_resources.cpus_per_proc=0",  # unpinned: beside the first replica
    )
    out = submit_grpo(run_dir, free_port(), "--nodes=2", *args, partition=PARTITION)
    job, log = submitted(out, run_dir)
    try:
        wait_until(lambda: len(_logged(run_dir)) >= 2, "two steps", log)
        placement = json.loads((run_dir / "placement.json").read_text())
        hosts = [m["hosts"][0] for m in placement if m["mesh"] == "Generator"]
        trainer = next(m["hosts"][0] for m in placement if m["mesh"] == "TitanTrainer")
        (node,) = set(hosts) - {trainer}
        _kill_node(node)
        wait_until(lambda: "not respawned" in log.read_text(), "the loss noticed", log, 60)
        # Back, so that SLURM can end the job there (else it waits out SlurmdTimeout).
        subprocess.run(["bash", ".ci/slurm.sh"], cwd=ROOT, check=True, capture_output=True)
        wait_job_done(job, log)
    finally:
        subprocess.run(["scancel", job])
    text = log.read_text()
    (lost,) = [line for line in text.splitlines() if "not respawned" in line]
    assert re.match(f"Generator replica [01] not respawned: node {node} lost: ", lost), lost
    assert "requeued" not in text and "resuming" not in text
    assert _logged(run_dir) == list(range(1, steps + 1))


def test_a_notebook_outside_the_job_trains_on_both_nodes_and_its_end_leaves_nothing(tmp_path):
    """A kernel in this machine's own namespace (the login node) asks SLURM for a two-node job
    (`launcher: slurm`), takes two GRPO steps there and is killed without closing the run: no
    job and no process stays on either node."""
    run_dir, jobs = tmp_path / "run", active_jobs()
    overrides = [
        f"run_dir={run_dir}",
        "reward.functions=[helper_rewards:vowel_fraction]",
        "provisioner.launcher=slurm",
        "provisioner.hosts=2",
        f"provisioner.slurm.partition={PARTITION}",
        f"provisioner.slurm.port={free_port()}",
        f"provisioner.slurm.log_dir={tmp_path}",
        # This machine's hostname resolves to loopback: it listens where the nodes route to.
        f"provisioner.slurm.driver_address={_address_towards('forge-node1')}",
        *TWO_HOSTS,
    ]
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    try:
        _cell(
            client,
            f"from forge.controller.notebook import library_output_to, replace\n"
            f"library_output_to({str(tmp_path / 'notebook.log')!r})",
        )
        _cell(
            client,
            "from forge.cli import import_app\nfrom forge.config import load_config\n"
            "grpo = import_app('apps/grpo/main.py')\n"
            f"cfg = load_config(grpo.Config, {TINY!r}, {overrides!r})\n"
            "run = await replace('run', grpo.GRPO.start(cfg))\n"
            "await run.steps(2)",
        )
        (job,) = active_jobs() - jobs
        nodes = {role: _networks(job, role) for role in ("trainer", "generator")}
        # The run is not closed: the kernel is killed, as its crash would (or a restart that
        # finds it unresponsive): nothing in it runs at its end.
        manager.shutdown_kernel(now=True)
    finally:
        client.stop_channels()
        if manager.is_alive():
            manager.shutdown_kernel(now=True)
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    assert [r["policy_versions"] for r in trained(run_dir)] == [[0] * 8, [1] * 8]
    assert {frozenset(n) for n in nodes.values()} == {
        frozenset({_namespace("forge-node1")}),
        frozenset({_namespace("forge-node2")}),
    }
    log = tmp_path / "notebook.log"
    gone = lambda: job not in active_jobs() and not job_processes(job)  # noqa: E731
    wait_until(gone, "the job and its processes gone", log, 120)
    for node in ("forge-node1", "forge-node2"):
        left = [p.cmdline() for p in map(psutil.Process, _node_pids(node)) if p.name() != "slurmd"]
        assert not left, (node, left)


def _cell(client, code: str) -> None:
    reply = client.execute_interactive(code, timeout=600, output_hook=lambda msg: None)
    assert reply["content"]["status"] == "ok", reply["content"]


def _address_towards(host: str) -> str:
    """This machine's address on the route to `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))  # no packet: it only picks the route
        return s.getsockname()[0]


def _node_pids(node: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, check=True)
    return [int(pid) for pid in out.stdout.split()]


def _logged(run_dir: Path) -> list[int]:
    return [m["step"] for m in metrics(run_dir)] if (run_dir / "metrics.jsonl").exists() else []


def _kill_node(node: str) -> None:
    """Kills every process in the node's network namespace: its slurmd, job steps, workers."""
    for pid in _node_pids(node):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # ended meanwhile


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
