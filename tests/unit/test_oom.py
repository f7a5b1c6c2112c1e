"""A trainer the OOM killer ended is named and restarted once; ended again at the same step,
the run stops and says what to change (the kill itself, under a real cgroup memory limit, is
tests/e2e/test_resume.py's)."""

import pytest

from forge.loop import trainer_lifecycle
from forge.loop.config import RunConfig
from forge.loop.trainer_handle import TrainerDied
from forge.loop.trainer_lifecycle import TrainerLifecycle

DIED = "a trainer process died during train_step"


def test_a_second_oom_kill_at_the_same_step_ends_the_run_with_what_to_change(monkeypatch, tmp_path):
    lifecycle = TrainerLifecycle(None, RunConfig(run_dir=str(tmp_path)), None, None, None, 0)
    lifecycle._pids = [11, 12]  # as `watch` learns them: rank 1 is pid 12
    killed: dict[int, int] = {}
    monkeypatch.setattr(trainer_lifecycle, "oom_kills", lambda pids, since: killed)

    assert lifecycle._oom_told(TrainerDied(DIED), 4).args == (DIED,)  # killed otherwise
    killed[12] = 3 << 30
    told = lifecycle._oom_told(TrainerDied(DIED), 4)
    assert str(told) == f"{DIED}: the OOM killer ended rank 1 (pid 12), holding 3.00 GB"
    assert lifecycle._oom_told(TrainerDied(DIED), 5) is not None  # another step: restarted
    with pytest.raises(RuntimeError) as stopped:
        lifecycle._oom_told(TrainerDied(DIED), 5)
    assert str(stopped.value) == (
        f"{told}, again at step 5: not restarted. Ask less memory of it: a smaller "
        "trainer.micro_batch_size (now 0: the whole batch) or fewer sequences a step, or give "
        "its processes more memory"
    )
