"""`forge serve` driven by the real `tinker` SDK (0.38.0) on the tiny model: real trainer and
generator processes behind the Tinker REST API, one server for the file (and a second on the
same folder, for a restart)."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import tinker
from tinker import types

from forge.weights.shm_folders import run_folder

ROOT = Path(__file__).resolve().parents[2]
KEY = "tml-forge-test-key"
BASE = "tiny-llama"
TIMEOUT = 600  # seconds a future may take: a model's start is its processes' and engine's


def start_server(state_dir: Path) -> tuple[subprocess.Popen, str]:
    address = state_dir / "serve.json"
    address.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "forge",
            "serve",
            "--config",
            "configs/serve/tiny_cpu.yaml",
            f"state_dir={state_dir}",
            "port=0",
            "heartbeat_timeout_s=30",
        ],
        cwd=ROOT,
        env={**os.environ, "TINKER_API_KEY": KEY},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not address.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "forge serve wrote no serve.json"
        time.sleep(0.1)
    port = json.loads(address.read_text())["port"]
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("serve")
    proc, url = start_server(state_dir)
    yield state_dir, url, proc
    if proc.poll() is None:
        out = stop_server(proc)
        assert proc.returncode == 128 + signal.SIGTERM or "stopped" in out, out


@pytest.fixture(scope="module")
def service(server):
    os.environ["TINKER_TELEMETRY"] = "0"
    client = tinker.ServiceClient(base_url=server[1], api_key=KEY)
    yield client


@pytest.fixture(scope="module")
def model(service):
    return service.create_lora_training_client(base_model=BASE, rank=8).result(timeout=TIMEOUT)


def datum(tokens: list[int], **inputs: list[float]) -> types.Datum:
    """A next-token datum: the tokens but the last in, the tokens but the first as targets."""
    n = len(tokens) - 1
    tensors = {"target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n])}
    for name, values in inputs.items():
        tensors[name] = types.TensorData(data=values, dtype="float32", shape=[n])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=tensors)


SEQUENCES = [[5, 17, 300, 42, 9, 77, 1000, 3], [11, 12, 13, 14, 15]]


def test_a_request_without_the_key_is_refused(server):
    for headers in ({}, {"X-API-Key": "tml-wrong"}):
        answer = httpx.post(f"{server[1]}/api/v1/create_session", json={}, headers=headers)
        assert answer.status_code == 401 and "X-API-Key" in answer.json()["detail"]


def test_each_loss_sums_its_per_token_formula_over_the_returned_logprobs(model):
    rng = np.random.default_rng(0)
    data = {
        "cross_entropy": [datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQUENCES],
    }
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        data[name] = [
            datum(
                s,
                logprobs=list(-rng.uniform(9, 12, len(s) - 1)),
                advantages=list(rng.normal(size=len(s) - 1)),
            )
            for s in SEQUENCES
        ]
    beta = 0.05  # dro's penalty weight
    for name, batch in data.items():
        config = {"beta": beta} if name == "dro" else None
        out = model.forward(batch, name, loss_fn_config=config).result(timeout=TIMEOUT)
        expected = 0.0
        for d, o in zip(batch, out.loss_fn_outputs, strict=True):
            lp = o["logprobs"].to_numpy().astype(np.float64)
            x = {k: v.to_numpy().astype(np.float64) for k, v in d.loss_fn_inputs.items()}
            assert lp.shape == x["target_tokens"].shape and np.all(lp < 0)
            if name == "cross_entropy":
                expected += -(x["weights"] * lp).sum()
                continue
            ratio, a = np.exp(lp - x["logprobs"]), x["advantages"]
            if name == "importance_sampling":
                expected += -(ratio * a).sum()
            elif name == "ppo":
                expected += -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a).sum()
            elif name == "dro":
                expected += -(lp * a - 0.5 * beta * (lp - x["logprobs"]) ** 2).sum()
            else:
                expected += -(np.clip(ratio, 0.8, 1.2) * lp * a).sum()
        assert math.isclose(out.metrics["loss:sum"], expected, rel_tol=1e-4), name


def test_a_custom_loss_trains_through_forward_and_weighted_cross_entropy(model):
    """forward_backward_custom: the SDK takes logprobs by `forward`, differentiates the
    client's loss, and sends the gradient back as cross-entropy weights."""
    batch = [datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQUENCES]
    nll = model.forward(batch, "cross_entropy").result(timeout=TIMEOUT).metrics["loss:sum"]

    def custom(data, logprobs):
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"custom_nll:sum": float(loss.detach())}

    out = model.forward_backward_custom(batch, custom).result(timeout=TIMEOUT)
    assert math.isclose(out.metrics["custom_nll:sum"], nll, rel_tol=1e-5)


def test_steps_lower_the_loss_and_the_sampler_serves_exactly_the_saved_weights(model):
    batch = [datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQUENCES]
    losses = []
    for _ in range(3):
        step = model.forward_backward(batch, "cross_entropy")
        model.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT)
        losses.append(step.result(timeout=TIMEOUT).metrics["loss:sum"])
    assert losses[2] < losses[0], losses
    trainer = model.forward(batch, "cross_entropy").result(timeout=TIMEOUT)
    sampler = model.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
    # The sampler's logprobs of the same tokens, under the version just saved: the engines
    # agree up to numerics (mismatch KL, k3, over every token).
    kl = []
    for s, out in zip(SEQUENCES, trainer.loss_fn_outputs, strict=True):
        prompt = types.ModelInput.from_ints(s)
        generator = np.array(sampler.compute_logprobs(prompt).result(timeout=TIMEOUT)[1:])
        train = out["logprobs"].to_numpy().astype(np.float64)
        log_ratio = generator - train
        kl += list(np.exp(log_ratio) - 1 - log_ratio)
    assert np.mean(kl) < 1e-3, np.mean(kl)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=0)
    result = sampler.sample(types.ModelInput.from_ints(SEQUENCES[0]), 3, params).result(
        timeout=TIMEOUT
    )
    assert len(result.sequences) == 3
    for sequence in result.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) == 6
        assert sequence.stop_reason == "length"


def test_bad_input_gets_its_one_line_error_and_the_model_keeps_working(model, service):
    good = [datum(SEQUENCES[0], weights=[1.0] * 7)]
    failures = {
        "unknown loss_fn 'dpo'": lambda: model.forward(good, "dpo"),
        "needs loss_fn_inputs ['advantages', 'logprobs']": lambda: model.forward(
            good, "importance_sampling"
        ),
        "takes no loss_fn_config key eps": lambda: model.forward(
            good, "ppo", loss_fn_config={"eps": 0.1}
        ),
    }
    for expected, call in failures.items():
        with pytest.raises(tinker.RequestFailedError, match=re.escape(expected)):
            call().result(timeout=TIMEOUT)
    short = datum(SEQUENCES[0], weights=[1.0] * 7)
    short.loss_fn_inputs["weights"] = types.TensorData(data=[1.0] * 3, dtype="float32", shape=[3])
    with pytest.raises(tinker.RequestFailedError, match="has 3 values for 7 input tokens"):
        model.forward([short], "cross_entropy").result(timeout=TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match="'gpt-5' is not served here"):
        service.create_lora_training_client(base_model="gpt-5", rank=8).result(timeout=TIMEOUT)
    sampler = model.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
    too_long = types.ModelInput.from_ints(list(range(5, 600)))
    with pytest.raises(tinker.RequestFailedError, match="context"):
        sampler.sample(too_long, 1, types.SamplingParams(max_tokens=4)).result(timeout=TIMEOUT)
    out = model.forward(good, "cross_entropy").result(timeout=TIMEOUT)
    assert out.metrics["loss:sum"] > 0


def test_a_client_that_stops_its_heartbeats_is_dropped_with_its_model(server, model):
    """A session made by hand, which sends no heartbeat: after heartbeat_timeout_s (30 s in
    this file) the server closes it and stops its model's processes."""
    url = server[1]
    headers = {"X-API-Key": KEY}
    session = httpx.post(f"{url}/api/v1/create_session", json={}, headers=headers).json()
    body = {
        "session_id": session["session_id"],
        "model_seq_id": 0,
        "base_model": BASE,
        "lora_config": {"rank": 4},
    }
    future = httpx.post(f"{url}/api/v1/create_model", json=body, headers=headers).json()
    while "model_id" not in (
        result := httpx.post(
            f"{url}/api/v1/retrieve_future", json=future, headers=headers, timeout=60
        ).json()
    ):
        assert result.get("type") == "try_again", result
        beat = {"session_id": session["session_id"]}  # alive while the model starts, then silent
        httpx.post(f"{url}/api/v1/session_heartbeat", json=beat, headers=headers)
    # A sampler of it; a look-up of a sampler is no sign of the client's life, as its requests
    # to the model are.
    save = {"model_id": result["model_id"], "seq_id": 1, "sampling_session_seq_id": 0}
    future = httpx.post(f"{url}/api/v1/save_weights_for_sampler", json=save, headers=headers)
    while "sampling_session_id" not in (
        saved := httpx.post(
            f"{url}/api/v1/retrieve_future", json=future.json(), headers=headers, timeout=60
        ).json()
    ):
        assert saved.get("type") == "try_again", saved
    sampler = f"{url}/api/v1/samplers/{saved['sampling_session_id']}"
    assert httpx.get(sampler, headers=headers).status_code == 200
    processes = len(psutil.Process(server[2].pid).children(recursive=True))
    deadline = time.monotonic() + 120
    while httpx.get(sampler, headers=headers).status_code != 404:
        assert time.monotonic() < deadline, "the silent session was never closed"
        time.sleep(0.5)
    # Its trainer's and generator's processes are gone (polled: they exit as they are told).
    while len(psutil.Process(server[2].pid).children(recursive=True)) >= processes:
        assert time.monotonic() < deadline, "the closed model's processes are still running"
        time.sleep(0.5)
    # The SDK's session, which sends heartbeats, is still served.
    batch = [datum(SEQUENCES[1], weights=[1.0] * 4)]
    assert model.forward(batch, "cross_entropy").result(timeout=TIMEOUT).metrics["loss:sum"] > 0


def test_a_saved_state_loads_in_a_restarted_server_and_continues_bit_for_bit(model, server):
    """Last in the file: it stops the file's server."""
    state_dir, _, proc = server
    batch = [datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQUENCES]
    model.forward_backward(batch, "cross_entropy")
    model.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT)
    path = model.save_state("before").result(timeout=TIMEOUT).path
    assert path.startswith(f"tinker://{model.model_id}/weights/")

    def logprobs(client) -> list[np.ndarray]:
        out = client.forward(batch, "cross_entropy").result(timeout=TIMEOUT)
        return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]

    def step_then_logprobs(client) -> list[np.ndarray]:
        client.forward_backward(batch, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT)
        return logprobs(client)

    expected = step_then_logprobs(model)
    assert "stopped" in stop_server(proc)
    assert not run_folder(state_dir).exists()  # the versions' shared memory, given back
    proc, url = start_server(state_dir)
    try:
        other = tinker.ServiceClient(base_url=url, api_key=KEY)
        loaded = other.create_training_client_from_state_with_optimizer(path)
        # A second model from the same state, beside it: training one leaves the other alone.
        beside = other.create_training_client_from_state_with_optimizer(path)
        loaded, beside = loaded.result(timeout=TIMEOUT), beside.result(timeout=TIMEOUT)
        before = logprobs(beside)
        for a, b in zip(expected, step_then_logprobs(loaded), strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(before, logprobs(beside), strict=True):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(before[0], expected[0])
    finally:
        stop_server(proc)
