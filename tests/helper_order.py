"""Runs the slowest test files first, so that the two xdist workers finish together.

`make test` runs `-n 2 --dist loadfile --no-loadscope-reorder`: each worker takes the next
file in collection order when it runs low. xdist's default order (most tests first) left the
few-test, many-minute end-to-end files for last, where one of them could run alone while the
other worker sat idle. Seconds are from the last full suite's durations
(bench/results/suite.json), with setup. test_slurm_nodes.py (~300 s) keeps its place at the
end, well after test_slurm.py: its jobs take both of the test cluster's nodes.
"""

import pytest

SLOWEST_FIRST = (
    "e2e/test_learning.py",  # ~1450 s: every SmolLM2 learning run, one after another
    "e2e/test_notebooks.py",  # ~530 s: 02 to 06 on the tiny models, 07 against forge serve
    "e2e/test_grpo.py",  # ~650 s
    "e2e/test_docs_examples.py",  # ~250 s: the docs' runnable blocks, two tiny runs among them
    "e2e/test_chaos.py",  # ~490 s: one run killed nine times, relaunched twice
    "integration/test_trainer.py",  # ~470 s
    "e2e/test_replay.py",  # ~210 s
    "e2e/test_live_control.py",  # ~170 s: a run steered, killed, run again and replayed
    "e2e/test_resume.py",  # ~270 s
    "e2e/test_distillation.py",  # ~210 s
    "e2e/test_colocated.py",  # ~180 s
    "integration/test_slurm.py",  # ~150 s
    "integration/test_tinker_server.py",  # ~140 s: forge serve and four models, one restart
    "e2e/test_own_data.py",  # ~130 s: GRPO killed and resumed, then SFT beside distillation
    "e2e/test_tinker_cookbook.py",  # ~120 s: the cookbook's SL and RL loops, a server each
    "e2e/test_given_back.py",  # ~100 s
    "integration/test_generator_service.py",  # ~130 s
    "e2e/test_stop_signals.py",  # ~160 s: two runs stopped by SIGTERM, one resumed
    "e2e/test_roles.py",  # ~60 s: SFT with eval off starts its trainer alone
)


def _rank(item: pytest.Item) -> int:
    path = item.path.as_posix()
    for rank, tail in enumerate(SLOWEST_FIRST):
        if path.endswith("tests/" + tail):
            return rank
    return len(SLOWEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: each file's tests keep their order
