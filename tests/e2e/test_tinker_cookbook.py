"""tinker-cookbook's own training loops (0.5.8), unchanged, against `forge serve`, run as `make
tinker` runs them: examples/tinker/with_server.py starts the server, and the client scripts run
in the Tinker client venv (.venv-tinker, `make tinker-env`; `make test` builds it first)."""

import json
import subprocess
import sys
from pathlib import Path

from forge.models import resolve_model

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / ".venv-tinker" / "bin" / "python"


def tiny_model_folder() -> Path:
    """The tiny model's folder: the client loads the tokenizer from the name it sends."""
    return resolve_model("tiny-llama")


def cookbook_run(tmp_path: Path, config: str, script: str, *settings: str) -> list[dict]:
    """Runs a client script against a server of `config`; the cookbook's metrics, a dict a
    step."""
    log = tmp_path / "cookbook"
    command = [
        *(sys.executable, "examples/tinker/with_server.py", "--config", f"configs/serve/{config}"),
        f"state_dir={tmp_path / 'serve'}",
        *("--", str(CLIENT), f"examples/tinker/{script}", f"log_path={log}", *settings),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "forge serve: stopped" in (tmp_path / "serve" / "serve.out").read_text()
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def test_the_cookbooks_supervised_loop_lowers_the_held_out_loss_on_the_tiny_model(tmp_path):
    """sl_conversations.py: the cookbook's conversations, 6 steps of 8 at a high learning rate
    (the tiny model is random: its loss is the vocabulary's log-size before training). The
    cookbook's evaluator scores the 16 held-out conversations through a sampler on each
    step's weights (compute_logprobs) at steps 0 and 5."""
    metrics = cookbook_run(
        tmp_path,
        "tiny_cpu.yaml",
        "sl_conversations.py",
        f"model_name={tiny_model_folder()}",
        "max_steps=6",
        "eval_every=5",
        "learning_rate=5e-3",
    )
    assert [m["step"] for m in metrics] == list(range(6))
    held_out = [m["test/nll"] for m in metrics if "test/nll" in m]
    train = [m["train_mean_nll"] for m in metrics]
    print(f"held-out nll {held_out}, train nll {train}")
    assert len(held_out) == 2 and held_out[1] < held_out[0] - 0.1
    assert train[-1] < train[0]


def test_the_cookbooks_rl_loop_samples_grades_and_trains_on_the_tiny_model(tmp_path):
    """rl_additions.py, as `make tinker` runs it, 2 steps of 2 questions x 4 tries: the
    cookbook samples from a sampler on each step's weights, grades with our dataset's env,
    trains with importance sampling and evaluates the held-out questions first. The tiny
    model is random, so the test asks for the loop, not for learning."""
    metrics = cookbook_run(
        tmp_path,
        "tiny_cpu.yaml",
        "rl_additions.py",
        f"model_name={tiny_model_folder()}",
        "max_steps=2",
        "eval_every=2",
        "dataset_builder.batch_size=2",
        "dataset_builder.group_size=4",
        "dataset_builder.test_size=8",
    )
    assert [m["step"] for m in metrics] == [0, 1]
    assert "test/env/all/reward/total" in metrics[0]
    for m in metrics:
        assert m["env/all/total_episodes"] == 8, m
        # The cookbook's own check that the sampler served the trainer's weights: the KL
        # between the sampler's logprobs of its tokens and the trainer's.
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m
