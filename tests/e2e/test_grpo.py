"""The GRPO app end to end, through `python -m forge run`, on real processes and vLLM.

Tiny-model runs check the machinery (sync == async at max_policy_age 0, split and colocated;
surviving a killed generator); test_learning.py checks that GRPO on SmolLM2 learns the task
`make grpo` trains on.
"""

import re
import signal
from collections import Counter

import psutil
import pytest
from helper_runs import (
    complete_groups,
    console,
    finish,
    finish_all,
    forge_run,
    kill_one_after_3_steps,
    metrics,
    processes_of,
    shm_mapped,
    trained,
    wait_for_metric,
    wait_for_steps,
)

from forge.observability import read_timeline
from forge.weights.shm_folders import run_folder

pytestmark = pytest.mark.integration

VOWELS = "reward.functions=[helper_rewards:vowel_fraction]"
TINY = "configs/grpo/tiny_cpu.yaml"


def grpo(config: str, run_dir, *overrides: str):
    return forge_run("grpo", config, run_dir, *overrides)


@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_sync_mode_and_async_at_age_zero_train_on_the_same_data(placement, tmp_path):
    runs = {mode: tmp_path / mode for mode in ("sync", "async")}
    # Both at once: start-up is mostly waiting, and the runs share nothing but the machine.
    procs = {
        mode: grpo(
            TINY,
            run_dir,
            VOWELS,
            f"mode={mode}",
            f"placement={placement}",
            "steps=3",
            "buffer.max_policy_age=0",
            "export_hf=false",
        )
        for mode, run_dir in runs.items()
    }
    finish_all(procs, runs)
    assert not any(run_folder(d).exists() for d in runs.values())  # weight versions cleared
    sync, asynchronous = (trained(runs[m]) for m in ("sync", "async"))
    assert [s["episodes"] for s in sync] == [a["episodes"] for a in asynchronous]
    for key in ("train/loss", "train/grad_norm"):
        sync_values, async_values = ([m[key] for m in metrics(runs[mode])] for mode in runs)
        assert sync_values == pytest.approx(async_values, rel=1e-5, abs=1e-6), key
    # Fresh data gives ratio 1 and group-normalised advantages average to ~0, so the loss value
    # is ~0 in both modes; the gradient shows that the step really trained on something.
    assert min(m["train/grad_norm"] for m in metrics(runs["sync"])) > 1e-3
    for run_dir in runs.values():
        _console_shows_forge_lines_only(run_dir, steps=3)


def test_generators_take_new_weights_while_the_trainer_takes_its_next_step(tmp_path):
    """Async at max_policy_age 1, one run per update mode (at once, as above): the trainer
    starts step s+1 before the generators are done moving to version s (timestamps from the
    trainer's and the generators' own processes), and no batch is older than the age allows.
    Under drain, the admission gate's bound keeps the buffer from dropping anything stale: a
    rollout admitted while a generator prepares a version waits for that version."""
    runs = {mode: tmp_path / mode for mode in ("drain", "abort", "inflight")}
    procs = {
        mode: grpo(
            TINY,
            d,
            VOWELS,
            "steps=4",
            f"generator.update_mode={mode}",
            "export_hf=false",
            "eval.interval=4",  # before step 1 and after step 4: on the timeline
            "eval.size=4",
        )
        for mode, d in runs.items()
    }
    finish_all(procs, runs)
    for mode, run_dir in runs.items():
        spans = read_timeline(run_dir)
        train = {s["step"]: s for s in spans if s["what"] == "train"}
        updated: dict[int, float] = {}  # step -> when the last generator finished its swap
        for s in spans:
            if s["what"] == "swap":
                updated[s["step"]] = max(updated.get(s["step"], 0.0), s["end"])
        assert sorted(train) == [1, 2, 3, 4] and sorted(updated) == [1, 2, 3, 4], mode
        overlapped = [s for s in (1, 2, 3) if train[s + 1]["start"] < updated[s]]
        print(f"{mode}: trainer began the next step before the update ended at steps {overlapped}")
        assert overlapped, f"{mode}: every update held up the trainer's next step"
        # The generator's own intervals: rollouts went on while the trainer trained, and the
        # evals (before step 1 and after the last) are drawn on its lane too.
        generating = [s for s in spans if s["lane"] == "generator 0" and s["what"] == "generate"]
        assert any(
            g["start"] < t["end"] and t["start"] < g["end"]
            for g in generating
            for t in train.values()
        ), mode
        evals = [s for s in spans if s["lane"] == "generator 0" and s["what"] == "eval"]
        assert len(evals) >= 2 and all(s["start"] <= s["end"] for s in evals), mode
        for record in trained(run_dir):
            ages = [record["trainer_version"] - v for v in record["policy_versions"]]
            assert 0 <= min(ages) and max(ages) <= 1, (mode, record)
        if mode == "drain":
            assert metrics(run_dir)[-1]["buffer/evicted_stale"] == 0
        assert (run_dir / "timeline.png").stat().st_size > 0


def test_groups_reused_and_gone_stale_are_trained_whole_or_dropped_whole(tmp_path):
    """Async, drain updates, FIFO with `max_reuse: 2` at `max_policy_age: 1`: a group trains at
    two versions, so the groups queued behind it grow stale and are evicted. Every trained
    group is whole in its step, and what was evicted is whole groups."""
    run_dir = tmp_path / "groups"
    group_size = 4  # the tiny config's
    finish(grpo(TINY, run_dir, VOWELS, "steps=6", "buffer.max_reuse=2", "export_hf=false"), run_dir)
    steps, records = metrics(run_dir), trained(run_dir)
    uses: Counter[str] = Counter()
    for record in records:
        groups = Counter(e.split("-")[0] for e in record["episodes"])
        assert set(groups.values()) == {group_size}, record  # each group whole, none split
        uses.update(groups.keys())
        ages = [record["trainer_version"] - v for v in record["policy_versions"]]
        assert 0 <= min(ages) and max(ages) <= 1, record  # by the group's oldest sample
    assert max(uses.values()) == 2  # reuse happened
    evicted = int(max(m["buffer/evicted_stale"] for m in steps))
    print(f"groups trained {len(uses)}, evicted stale {evicted // group_size} (whole)")
    assert evicted > 0 and evicted % group_size == 0
    # A group never trained although a later one was: evicted whole (or still on its way).
    never = set(map(str, range(max(map(int, uses))))) - set(uses)
    assert len(never) <= evicted // group_size + 16 // group_size, never  # 16: the gate's limit


def test_a_killed_generator_replica_is_replaced_no_episode_is_lost_and_ctrl_c_ends_cleanly(
    tmp_path,
):
    """A generator replica is killed mid-run: it is replaced and no episode is lost. The run is
    then stopped with Ctrl-C, which writes a final checkpoint, the plots and the export, and
    leaves no process, no weight-transport folder and nothing its processes mapped in /dev/shm
    behind."""
    run_dir = tmp_path / "kill"
    replicas = "generator_resources.num_replicas=2"
    proc = grpo(TINY, run_dir, VOWELS, "steps=1000", replicas)
    try:
        kill_one_after_3_steps(proc, run_dir, _generator_processes, 2)
        # The run goes on while the replica is respawned (a new process and engine); it is
        # stopped (Ctrl-C) three steps after the replacement is back.
        recovered = wait_for_metric(proc, run_dir, "generator/recoveries")
        wait_for_steps(proc, run_dir, recovered + 3)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        mapped, _ = shm_mapped(proc.pid)
        assert any(run_folder(run_dir) in p.parents for p in mapped), mapped  # versions
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (run_dir / "checkpoints" / "latest").exists()
    assert (run_dir / "metrics.png").exists()
    assert (run_dir / "hf" / "model.safetensors").exists()  # the export runs on Ctrl-C too
    assert not run_folder(run_dir).exists()  # the run's weight transport
    assert not [p for p in mapped if p.exists()]
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    steps = metrics(run_dir)
    assert max(m.get("generator/deaths", 0) for m in steps) >= 1
    assert not any(m.get("rollout/failed_groups") for m in steps)
    records = trained(run_dir)
    assert [r["step"] for r in records[: len(steps)]] == [m["step"] for m in steps]
    assert all(len(r["episodes"]) == 8 for r in records)  # every step full
    complete_groups(run_dir, 4, steps)
    # Generator vs trainer logprobs of the same tokens under the same weights, every step.
    assert all(m["train/mismatch_kl"] < 1e-3 for m in steps)


def _console_shows_forge_lines_only(run_dir, steps: int) -> None:
    """The run's console (stdout and stderr) holds forge's lines, its library log the rest."""
    out = console(run_dir)
    for bad in ("fault", "Traceback", "MeshFailure"):
        assert bad not in out, bad
    lines = out.splitlines()
    library = [
        line for line in lines if re.search(r"(?i)warning|\bINFO\b|EngineCore|monarch|vllm", line)
    ]
    assert not library, library
    shown = [line.split(" |")[0] for line in lines if line.startswith("step ")]
    assert shown == [f"step {s}" for s in range(1, steps + 1)]
    assert lines[-3:] == [
        f"metrics: {run_dir / 'metrics.jsonl'}",
        f"plot: {run_dir / 'metrics.png'}",
        f"timeline: {run_dir / 'timeline.png'}",
    ]
    log = (run_dir / "forge.log").read_text()
    assert "EngineCore" in log and "WARNING" in log  # vLLM's engine process wrote there


def _generator_processes(driver: int) -> list[int]:
    """Generator actor processes: the parents of vLLM engine processes under the driver."""
    return [psutil.Process(p).ppid() for p in processes_of(driver, "EngineCore")]
