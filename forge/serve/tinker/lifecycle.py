"""`forge serve`'s life: its key and address files, the HTTP server, the heartbeat reaper, and
on the way out (Ctrl-C, SIGTERM, an error) every model's processes and shared memory given
back."""

import asyncio
import contextlib
import json
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from forge.controller import get_provisioner, shutdown
from forge.observability.console import say
from forge.serve.tinker.config import ServeConfig
from forge.serve.tinker.server import TinkerServer
from forge.weights.shm_folders import ShmFolder, run_folder

KEY_FILE = "api_key"
ADDRESS_FILE = "serve.json"


def api_key(state_dir: Path) -> str:
    """The key clients must send: TINKER_API_KEY if set, else the one in `state_dir/api_key`
    (made on the first start, readable by its owner only), so a restart keeps it."""
    if key := os.environ.get("TINKER_API_KEY"):
        if not key.startswith("tml-"):
            raise ValueError("TINKER_API_KEY must start with 'tml-' (the tinker SDK checks it)")
        return key
    path = state_dir / KEY_FILE
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(f"tml-{secrets.token_hex(24)}")
    return path.read_text().strip()


async def serve(cfg: ServeConfig) -> None:
    """Serves the Tinker API until cancelled; then closes every session's models."""
    state_dir = Path(cfg.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    key = api_key(state_dir)
    shm = ShmFolder.create(run_folder(state_dir).name.removeprefix("forge-"), "forge serve")
    get_provisioner().own(shm)
    server = TinkerServer(cfg, key, shm.path)
    config = uvicorn.Config(server.app(), log_level="warning", lifespan="off")
    http = _Server(config)
    listener = _listen(cfg.host, cfg.port)
    port = listener.getsockname()[1]
    reaper = asyncio.ensure_future(server.reap())
    try:
        # The socket listens already: a client that comes before uvicorn accepts waits.
        serving = asyncio.ensure_future(http.serve(sockets=[listener]))
        address = {"host": cfg.host, "port": port, "pid": os.getpid()}
        (state_dir / ADDRESS_FILE).write_text(json.dumps(address))
        where = "TINKER_API_KEY" if os.environ.get("TINKER_API_KEY") else state_dir / KEY_FILE
        say(f"forge serve: Tinker API at http://{cfg.host}:{port} (key: {where})")
        await serving
    finally:
        reaper.cancel()
        server.futures.cancel_all()
        for session_id in list(server.sessions):
            await server.close_session(session_id)
        (state_dir / ADDRESS_FILE).unlink(missing_ok=True)
        http.should_exit = True
        listener.close()
        await shutdown()


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers (uvicorn 0.55's `capture_signals`): SIGINT
    and SIGTERM take forge's stop path (forge.loop.stop_signals), which cancels `serve`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (0: a free port); a one-line error if taken."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise OSError(f"forge serve cannot listen on {host}:{port}: {error.strerror}") from None
    listener.listen(128)
    return listener
