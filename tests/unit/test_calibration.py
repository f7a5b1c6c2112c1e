"""The calibration cache and the core counts it measures (forge/placement/calibration.py); the
measurement on a simulated machine is tests/unit/test_calibration_noise.py's, on the run's own
processes tests/e2e/test_colocated.py's."""

from pathlib import Path

from forge.cli import load_app
from forge.config import load_config
from forge.placement import calibration
from forge.placement.cost_model import PhaseCosts

ROOT = Path(__file__).parents[2]


def config(*overrides: str):
    schema = load_app(ROOT / "apps/grpo/main.py")[1]
    return load_config(schema, ROOT / "configs/grpo/smollm2_cpu.yaml", list(overrides))


def test_core_counts_cover_both_sides_of_every_split_considered():
    assert calibration.core_counts(1) == [1]
    assert calibration.core_counts(2) == [1, 2]
    assert calibration.core_counts(8) == [1, 2, 4, 6, 7, 8]
    for n in (2, 3, 8, 64):
        counts = set(calibration.core_counts(n))
        assert all(n - c in counts for c in counts if c < n)


def test_costs_round_trip_through_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "cache_path", lambda: tmp_path / "c" / "calibration.json")
    costs = PhaseCosts({1: 10.0, 2: 6.5}, {1: 60.0, 2: 33.0}, {1: 2.0, 2: 1.0}, 0.9, 0.07)
    assert calibration.load("k") is None
    calibration.save("k", costs)
    calibration.save("other", PhaseCosts({1: 1.0}, {1: 1.0}, {1: 0.0}, 0.0))
    assert calibration.load("k") == costs  # int core counts back from JSON's string keys
    calibration.forget("k")
    calibration.forget("never cached")
    assert calibration.load("k") is None and calibration.load("other") is not None


def test_the_key_changes_with_what_the_costs_depend_on_and_only_that():
    key = calibration.cache_key(config().workload(), 2)
    assert calibration.cache_key(config("steps=99", "run_dir=elsewhere").workload(), 2) == key
    assert calibration.cache_key(config().workload(), 4) != key
    for changed in ("buffer.batch_size=64", "generator.sampling.max_tokens=64",
                    "trainer.micro_batch_size=4", "trainer.model=tiny-llama",
                    "weight_sync.lora.rank=16", "trainer.dtype=bfloat16",
                    "weight_sync.dtype=bfloat16"):  # fmt: skip
        assert calibration.cache_key(config(changed).workload(), 2) != key, changed


def test_costs_measured_with_other_code_are_not_reused(monkeypatch):
    key = calibration.cache_key(config().workload(), 2)
    assert calibration.code_version() in key
    monkeypatch.setattr(calibration, "code_version", lambda: "edited")  # a source file changed
    assert calibration.cache_key(config().workload(), 2) != key
