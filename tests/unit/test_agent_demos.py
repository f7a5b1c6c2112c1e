"""apps/agent/demos.py: the agent recipe's warm-start demonstrations are episodes of the run's
own environment, played by the script (a calculator call, then the tool's result)."""

import json
import subprocess
import sys

from helper_configs import ROOT

from forge.envs.tools import CALL


def test_each_episode_gives_a_call_row_and_an_answer_row_with_the_environments_messages(
    tmp_path,
):
    out = tmp_path / "demos.jsonl"
    command = [sys.executable, "apps/agent/demos.py", "--config", "configs/agent/smollm2_cpu.yaml"]
    command += ["--out", str(out), "--rows", "3", "data.seed=1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith(f"6 demonstration turns of 3 episodes in {out}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6
    for call, answer in zip(rows[::2], rows[1::2], strict=True):
        system, user = call["prompt"]
        assert system["role"] == "system" and "calculator" in system["content"]
        (body,) = CALL.findall(call["target"])
        a, b = json.loads(body)["arguments"]["expression"].split(" * ")
        assert f"Calculate {a} * {b}." in user["content"]  # the row's own product
        assert answer["prompt"][:2] == call["prompt"]
        assert answer["prompt"][2] == {"role": "assistant", "content": call["target"]}
        assert answer["prompt"][3] == {"role": "tool", "content": str(int(a) * int(b))}
        assert answer["target"] == f"<answer>{int(a) * int(b)}</answer>"
        assert answer["answer"] == call["answer"] == str(int(a) * int(b))
