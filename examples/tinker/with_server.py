"""Runs a Tinker client command against a `forge serve` started for it, then stops the server.

    .venv/bin/python examples/tinker/with_server.py --config configs/serve/smollm2_cpu.yaml \\
        [key=value ...] -- COMMAND [ARG ...]

The server listens on a free port of 127.0.0.1 with a fresh key; the command finds both where
the `tinker` SDK looks for them (TINKER_BASE_URL, TINKER_API_KEY), and the local folder of the
served model in FORGE_MODEL_DIR (the cookbook loads its tokenizer from there). The server's
console lines go to `<state_dir>/serve.out`. The server is stopped (SIGTERM, which it ends on as
on Ctrl-C) when the command ends, however it ends, and when this script is interrupted or sent
SIGTERM or SIGKILL; the script exits with the command's status.
"""

import argparse
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from forge.config import load_config
from forge.models import resolve_model
from forge.serve.tinker.config import ServeConfig

PR_SET_PDEATHSIG = 1  # linux/prctl.h
START_S = 300  # the server's start: converting the model once, loading its imports


def _term_with_parent() -> None:
    """In the server's process before it starts: Linux sends it SIGTERM when this script
    dies, SIGKILL included (prctl PR_SET_PDEATHSIG), so no server outlives its client."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start(config: Path, overrides: list[str], state_dir: Path, key: str) -> subprocess.Popen:
    """`forge serve` on a free port, once it has written its address."""
    address = state_dir / "serve.json"
    address.unlink(missing_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "forge", "serve", "--config", str(config), *overrides]
    server = subprocess.Popen(
        [*command, "port=0", "host=127.0.0.1"],
        env={**os.environ, "TINKER_API_KEY": key},
        stdout=(state_dir / "serve.out").open("w"),
        stderr=subprocess.STDOUT,
        # A session of its own: a terminal's Ctrl-C reaches this script and the command, and
        # the server gets one SIGTERM from `stop` (a second signal would cut its cleanup short).
        start_new_session=True,
        preexec_fn=_term_with_parent,
    )
    deadline = time.monotonic() + START_S
    while not address.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            stop(server)
            tail = (state_dir / "serve.out").read_text().strip().splitlines()[-1:]
            sys.exit(f"with_server: forge serve did not start: {' '.join(tail)}")
        time.sleep(0.2)
    return server


def stop(server: subprocess.Popen) -> None:
    """SIGTERM, which `forge serve` ends on as on Ctrl-C, and its exit."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    sys.exit(128 + signum)  # unwinds through `finally`, which stops the server


def main() -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = argparse.ArgumentParser(usage=__doc__.split("\n\n")[1])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("overrides", nargs="*")
    argv = sys.argv[1:]
    if "--" not in argv:
        parser.error("give the client command after --")
    split = argv.index("--")
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    cfg = load_config(ServeConfig, args.config, args.overrides, available=True)
    key = os.environ.get("TINKER_API_KEY") or f"tml-{secrets.token_urlsafe(24)}"
    state_dir = Path(cfg.state_dir)
    server = start(args.config, args.overrides, state_dir, key)
    port = json.loads((state_dir / "serve.json").read_text())["port"]
    env = {
        **os.environ,
        "TINKER_BASE_URL": f"http://127.0.0.1:{port}",
        "TINKER_API_KEY": key,
        "FORGE_MODEL_DIR": str(resolve_model(cfg.base_models[0])),
    }
    try:
        status = subprocess.call(command, env=env)
    finally:
        stop(server)
    sys.exit(status)


if __name__ == "__main__":
    main()
