"""An engine core forked from forge's forkserver (`vllm_compat.preload_engine_cores`) samples
the same tokens, with the same logprobs, as the engine core vLLM spawns itself: the engine
arguments a Generator starts with, seeded sampling at temperature 1, a tiny model. The
forkserver's socket and the engine core's rendezvous file live in a forge shared-memory folder
of the caller, gone when it ends."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from forge.weights.shm_folders import SHM_ROOT

pytestmark = pytest.mark.integration

SCRIPT = """
import asyncio, json, multiprocessing.util, os, sys

from forge.actors.generator import GeneratorConfig
from forge.actors.vllm import vllm_compat
from forge.actors.vllm.engine import start_engine
from forge.models import tiny_model
from forge.weights.sync_config import WeightSyncConfig


async def sample(engine) -> list:
    from vllm import SamplingParams

    made = []
    for i, prompt in enumerate(["The answer is", "Once upon a time", "2 + 3 ="]):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=7 + i, logprobs=0)
        async for out in engine.generate(prompt, params, request_id=str(i)):
            last = out.outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(last.logprobs, last.token_ids)]
        made.append([last.token_ids, logprobs])
    return made


if __name__ == "__main__":
    if sys.argv[1] == "forked":
        vllm_compat.preload_engine_cores()
    cfg = GeneratorConfig(model=str(tiny_model("llama", seed=0, init_std=0.5)), kv_cache_mb=64)
    engine = start_engine(cfg, WeightSyncConfig(), cfg.model)
    try:
        made = asyncio.run(sample(engine))
        tempdir = multiprocessing.util.get_temp_dir()
        print(json.dumps({"sampled": made, "tempdir": tempdir, "files": os.listdir(tempdir)}))
    finally:
        engine.shutdown()
"""


def sampled(how: str, script) -> tuple[list, Path, list[str]]:
    """The samples, the multiprocessing temp folder the script's process used, and the files
    in it while the engine ran."""
    done = subprocess.run(
        [sys.executable, str(script), how], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # vLLM logs to stdout too, and may do so after the script's line (its shutdown).
    (line,) = [x for x in done.stdout.splitlines() if x.startswith('{"sampled"')]
    out = json.loads(line)
    return out["sampled"], Path(out["tempdir"]), out["files"]


def test_forked_engine_core_samples_what_a_spawned_one_does(tmp_path):
    script = tmp_path / "sample.py"
    script.write_text(SCRIPT)
    (spawned, _, _), (forked, tempdir, files) = (
        sampled("spawned", script),
        sampled("forked", script),
    )
    assert tempdir.parent == SHM_ROOT and tempdir.name.startswith("forge-mp-"), tempdir
    # The engine core's rendezvous file too: left by a killed engine core, but not in /tmp.
    assert any(f.startswith("vllm_dist_") for f in files), files
    assert not tempdir.exists()
    assert [tokens for tokens, _ in spawned] == [tokens for tokens, _ in forked]
    assert all(len(tokens) == 24 for tokens, _ in forked)
    assert spawned == forked  # logprobs too, to the bit
