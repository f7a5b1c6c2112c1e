"""The door of live control: a TCP endpoint in a run's driver that carries an attacher's calls
to the run (forge.loop.live_control), for the run's owner only.

It listens on `control.host` (this host only, by default) at a port the system picks, and
writes two files into the run folder while the run runs: `control.json` (its address and the
driver's pid) and `control.secret` (a random token, readable by its owner only). A call is one
JSON line `{"secret": ..., "call": ..., "args": {...}, "by": ...}`; its answer one JSON line,
`{"ok": result}` or `{"error": "one line"}`. A call without the secret is refused, and said on
the console. Each connection is served on its own task: the run never waits on an attacher,
and an attacher that dies leaves nothing behind.
"""

import asyncio
import contextlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.observability.console import say

ADDRESS_FILE = "control.json"
SECRET_FILE = "control.secret"
MAX_CALL_BYTES = 1 << 20  # one call's line; a longer one is refused, not buffered

Calls = dict[str, Callable[..., Awaitable[Any]]]


@dataclass
class ControlConfig:
    """Where a run's live control listens (docs/live_control.md).

    Args:
        host: the address the driver's control endpoint binds. Unset: this host only
            (127.0.0.1), but inside a SLURM job the node's own address, which the login node
            reaches. The secret guards it either way.
    """

    host: str | None = None

    def bind_address(self) -> str:
        """The address to listen on (`host`, or what unset means here)."""
        if self.host is not None:
            return self.host
        if "SLURM_JOB_ID" in os.environ:  # a `forge submit` job: attached from the login node
            with contextlib.suppress(OSError):
                address = ipaddress.ip_address(socket.gethostbyname(socket.gethostname()))
                if not address.is_loopback:
                    return str(address)
        return "127.0.0.1"


@contextlib.asynccontextmanager
async def opened_door(run_dir: Path, cfg: ControlConfig, calls: Calls) -> AsyncIterator[None]:
    """Serves `calls` while the block runs; the address and secret files go with it."""
    secret = secrets.token_hex(32)
    connections: set[asyncio.Task] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.add(asyncio.current_task())
        try:
            while line := await reader.readline():
                answer = await _answer(line, secret, calls, writer.get_extra_info("peername"))
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, ValueError):  # gone, or a line over MAX_CALL_BYTES
            pass
        finally:
            connections.discard(asyncio.current_task())
            writer.close()

    server = await asyncio.start_server(serve, cfg.bind_address(), 0, limit=MAX_CALL_BYTES)
    host, port = server.sockets[0].getsockname()[:2]
    _write_private(run_dir / SECRET_FILE, secret)
    address = {"host": host, "port": port, "pid": os.getpid()}
    tmp = run_dir / f"{ADDRESS_FILE}.tmp"
    tmp.write_text(json.dumps(address) + "\n")
    tmp.replace(run_dir / ADDRESS_FILE)
    try:
        yield
    finally:
        server.close()
        for task in list(connections):
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)
        for name in (ADDRESS_FILE, SECRET_FILE):
            (run_dir / name).unlink(missing_ok=True)


async def _answer(line: bytes, secret: str, calls: Calls, peer: Any) -> dict[str, Any]:
    """One call's answer; never raises for what the caller sent."""
    try:
        request = json.loads(line)
        given, name, args = request["secret"], request["call"], request.get("args", {})
        by = str(request.get("by", peer))
    except (ValueError, KeyError, TypeError):
        return {"error": 'malformed call: expected {"secret", "call", "args"} on one line'}
    if not isinstance(given, str) or not hmac.compare_digest(given, secret):
        say(f"live: refused a call of {name!r} from {peer}: wrong or missing secret")
        return {"error": "refused: wrong or missing secret (the run folder's control.secret)"}
    if name not in calls or not isinstance(args, dict):
        return {"error": f"no call {name!r} (calls: {', '.join(calls)})"}
    try:
        return {"ok": await calls[name](**args, by=by)}
    except (ValueError, TypeError) as e:
        return {"error": str(e).splitlines()[0] if str(e) else repr(e)}
    except Exception as e:  # the run's trouble, told to the attacher; the run goes on
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}


def _write_private(path: Path, text: str) -> None:
    """Writes `path` readable and writable by its owner only, from its first byte."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
