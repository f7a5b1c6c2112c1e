"""Metrics recorded in real Monarch processes, merged by the driver's MetricLogger."""

import math
import os
import sys

import cloudpickle
import pytest
from monarch.actor import endpoint

from forge.controller import ForgeActor, get_provisioner, shutdown
from forge.observability import FAILED_SOURCES_KEY, MetricLogger, Reduce, record_metric

pytestmark = pytest.mark.integration

# The worker processes cannot import this test module: ship the actor class by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Recorder(ForgeActor):
    """Records what it is told, shifted by 100 x its rank so every process's values differ."""

    @endpoint
    async def record(self, key: str, values: list[float], reduce: str = "mean") -> None:
        shift = 100 * int(os.environ["RANK"])
        for value in values:
            record_metric(key, value + shift, Reduce(reduce))


@pytest.fixture
async def provisioner():
    yield get_provisioner()
    await shutdown()


async def test_step_merges_every_process_with_the_driver(provisioner, tmp_path):
    mesh = await Recorder.options(procs=2).as_actor()  # ranks 0 and 1
    service = await Recorder.as_service()
    logger = MetricLogger(tmp_path, backends=[], sources=[mesh, service])

    await mesh.record.call("reward", [1.0, 2.0])  # 1, 2 and 101, 102
    await service.record.route("reward", [3.0])
    await mesh.record.call("tokens", [5.0], "sum")  # 5 and 105
    await service.record.route("spread", [1.0, 3.0], "std")
    await mesh.record.call("worst", [7.0], "min")  # 7 and 107
    record_metric("reward", 11.0)
    record_metric("spread", 5.0, Reduce.STD)
    record_metric("worst", 8.0, Reduce.MIN)
    record_metric("episodes", 0.0, Reduce.COUNT)

    metrics = await logger.step(1)
    assert metrics == {
        "episodes": 1.0,
        "reward": (1 + 2 + 101 + 102 + 3 + 11) / 6,
        "spread": pytest.approx(math.sqrt(8 / 3), rel=1e-12),  # std of 1, 3, 5
        "tokens": 5.0 + 105.0,
        "worst": 7.0,
    }
    # Every buffer was drained: nothing is counted twice.
    assert await logger.step(2) == {}


async def test_a_stopped_source_is_skipped_and_counted(provisioner, tmp_path):
    stopped = await Recorder.as_actor()
    alive = await Recorder.as_actor()
    logger = MetricLogger(tmp_path, backends=[], sources=[stopped, alive])
    await stopped.record.call("reward", [1.0])
    await alive.record.call("reward", [2.0])
    assert await logger.step(1) == {"reward": 1.5}

    await Recorder.shutdown(stopped)
    await alive.record.call("reward", [4.0])
    record_metric("reward", 6.0)
    assert await logger.step(2) == {FAILED_SOURCES_KEY: 1.0, "reward": 5.0}
