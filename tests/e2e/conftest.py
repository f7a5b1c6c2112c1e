from pathlib import Path

import pytest
from helper_runs import finish, forge_run

SFT_STEPS = 12


@pytest.fixture(scope="session")
def sft_smollm2(tmp_path_factory) -> Path:
    """The run folder of `make sft`'s config cut to 12 steps, with its exported model (`hf/`):
    the SFT learning test reads it, and the distillation learning test distils it."""
    run_dir = tmp_path_factory.mktemp("sft") / "learn"
    overrides = (
        f"steps={SFT_STEPS}",
        f"eval.interval={SFT_STEPS}",
        "trainer.checkpoint.folder=null",
    )
    finish(forge_run("sft", "configs/sft/smollm2_cpu.yaml", run_dir, *overrides), run_dir)
    return run_dir
