"""`forge replay` re-runs recorded training steps bit-exactly: a step of an async GRPO run whose
batches mixed policy versions and of a sync run, both on two FSDP ranks, and the whole async
run, which ends on its final checkpoint's parameters (one rank: a distillation run's step in
test_distillation.py; a killed and resumed sync run in test_resume.py, an async one in
test_chaos.py). A what-if under the recorded settings reproduces the record, one under another
clip differs, and keys that shape the batch are refused. The divergence guard keeps a batch that
blows up (tests/helper_blow_up.py) from being applied, skipping it or stopping the run, and its
replay command reproduces the blow-up. Tiny runs through `python -m forge run`, replays through
`python -m forge replay`; each replay starts a trainer, so one replay shows what it can (the
async run's step 4 is replayed under its recorded clip: bit-exact, and a what-if that reproduces
the record).
"""

import re
from pathlib import Path

import pytest
from helper_runs import console, finish, forge_replay, forge_run, metrics

from forge.actors.trainer.checkpoint_folder import latest_step
from forge.loop.record.batches import BatchRecord

pytestmark = pytest.mark.integration

STEPS = 5
COMMON = (
    f"steps={STEPS}",
    "export_hf=false",
    "trainer.checkpoint.interval=2",
    "trainer.checkpoint.keep=3",
    "record.batches=all",
)
TINY = "configs/grpo/tiny_cpu.yaml"
BLOW_UP = "tests/helper_blow_up.py"  # GRPO whose group 4 gets advantages of +-3e38
RUNS = {
    # On two FSDP ranks. One generator sequence slot per group: groups finish one at a time,
    # so a batch is often part old version, part new. The guard skips the step that trains
    # group 4.
    "async": (
        BLOW_UP,
        "mode=async",
        "buffer.batch_size=16",
        "generator.max_num_seqs=4",
        "trainer_resources.procs=2",
    ),  # fmt: skip
    # Sync, on two FSDP ranks: the guard stops it at the step that trains group 4.
    "stop": (
        BLOW_UP,
        "mode=sync",
        "trainer_resources.procs=2",
        "trainer.guard.action=stop",
    ),  # fmt: skip
}
BLOWN = re.compile(r"step (\d+) not applied: (.+) \(trainer.guard.action (\w+)\); replay it: (.*)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("replay")
    run_dirs = {name: root / name for name in RUNS}
    procs = {}
    for name, (app, *overrides) in RUNS.items():
        run_dir = run_dirs[name]
        reward = "reward.functions=[helper_rewards:vowel_fraction]"
        procs[name] = forge_run(app, TINY, run_dir, *COMMON, reward, *overrides)
    stopped = procs.pop("stop").wait(timeout=900)
    for name, proc in procs.items():
        finish(proc, run_dirs[name])
    assert stopped == 1  # the guard ended it
    return run_dirs


def test_an_async_run_with_mixed_versions_replays_a_step_and_the_whole_run_exactly(runs):
    record = BatchRecord(runs["async"])
    assert record.steps() == list(range(1, STEPS + 1))
    versions = [{e.policy_version for e in record.read(s).episodes()} for s in record.steps()]
    assert any(len(v) > 1 for v in versions), versions  # some batch mixed policy versions

    recorded_clip = "trainer.loss.clip_eps_high=0.28"  # a what-if under the recorded settings
    step = forge_replay(runs["async"], "--step", "4", recorded_clip)
    assert step.returncode == 0
    assert "from checkpoint step-2, steps 3..4 | what-if: " + recorded_clip in step.stdout
    assert "step 4: replayed bit-exactly" in step.stdout

    whole = forge_replay(runs["async"], "--all")
    assert whole.returncode == 0
    assert f"step {STEPS}: replayed bit-exactly" in whole.stdout
    assert f"after step {STEPS}: the same parameters as the final checkpoint" in whole.stdout


def test_a_step_of_a_sync_run_on_two_ranks_replays_bit_exactly(runs):
    done = forge_replay(runs["stop"], "--step", "2")  # before the blow-up
    assert done.returncode == 0
    assert "step 2: replayed bit-exactly" in done.stdout


def test_a_what_if_under_another_clip_differs_and_shapes_of_the_batch_are_refused(runs):
    tight = "trainer.loss.clip_eps_high=0.0001"
    other = forge_replay(runs["async"], "--step", "5", "trainer.loss.clip_eps_low=0.0001", tight)
    assert other.returncode == 1
    assert "step 5: differs from the record in loss, grad_norm, clip_frac" in other.stdout

    refused = forge_replay(runs["async"], "--step", "3", "trainer.model=tiny-qwen3")
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "trainer.model: a replay trains" in refused.stderr
    missing = forge_replay(runs["async"], "--step", "99")
    assert missing.returncode == 2
    assert f"step 99 is not recorded in {runs['async'] / 'batches'} (recorded: 1..5)" in (
        missing.stderr
    )


@pytest.mark.parametrize("name", ["async", "stop"])
def test_a_batch_that_blows_up_is_not_applied_and_its_replay_command_reproduces_it(runs, name):
    """Both runs print the replay command; the stopped run's is run (each replay starts a
    trainer, and the command is the same for both)."""
    (line,) = [m for m in map(BLOWN.search, console(runs[name]).splitlines()) if m]
    step, why, action, command = int(line.group(1)), *line.groups()[1:]
    assert why in ("loss nan", "loss inf", "loss -inf", "grad norm nan", "grad norm inf"), why
    assert command == f"forge replay {runs[name]} --step {step}"
    blown = BatchRecord(runs[name]).read(step)
    assert blown.figures["skipped"] == 1.0
    assert blown.params_after == blown.params_before  # not applied
    assert any(abs(e.advantage) == 3e38 for e in blown.episodes())
    logged = [m["step"] for m in metrics(runs[name])]
    if name == "async":
        assert action == "skip" and logged == list(range(1, STEPS + 1))
        return
    assert action == "stop" and logged == list(range(1, step))
    # No final checkpoint: resumed, the run takes the blown step again.
    assert latest_step(runs[name] / "checkpoints") < step
    assert "no final checkpoint" in console(runs[name])

    done = forge_replay(runs[name], *command.split()[3:])
    assert done.returncode == 0
    assert re.search(r"skipped +1\.0 +1\.0", done.stdout)
    recorded, replayed = re.search(r"\nloss +(\S+) +(\S+)", done.stdout).groups()
    assert recorded == replayed and recorded in ("nan", "inf", "-inf")
