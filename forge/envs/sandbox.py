"""Sandbox: a model's code runs in a process of its own, under limits, and leaves nothing behind.

Each call is a fresh interpreter (`python -I`) started in a temporary folder of its own, which
is removed afterwards. Where the machine has bubblewrap (`bwrap`, Debian's `bubblewrap`), the
call sees the file system read-only except that folder (also its TMPDIR), has no network (a
network namespace with no interface but loopback) and a PID namespace of its own: when its
first process ends, the kernel ends every process it started. Its processes and memory are
capped by a cgroup where forge may create one (v1 or v2 `pids` and `memory` controllers),
made inside the cgroup of the process that runs the sandbox, so the limits of what runs forge
(a SLURM job, a systemd unit) hold for the sandboxed code too;
elsewhere memory by an rlimit on each process's address space, and processes not at all. A
call still running at `timeout_s`, or whose caller cancels it, is killed with everything it
started. What it prints is cut to `output_bytes` per stream, read to the end so that the call
never blocks on a full pipe.

`guarantees()` says which of these hold on this machine.

    sandbox = Sandbox(SandboxConfig(timeout_s=5, memory_mb=256))
    result = await sandbox.run("print(6 * 7)")   # SandboxResult(status="ok", stdout="42\n", ...)
"""

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)
Status = Literal["ok", "error", "timeout", "memory"]
CGROUP_ROOT = Path("/sys/fs/cgroup")
_CHUNK = 1 << 16


@dataclass
class SandboxConfig:
    """Limits of one sandboxed call.

    Args:
        timeout_s: wall-clock limit; past it the call and every process it started are killed.
        memory_mb: memory of the call's processes together (a cgroup), or of each (rlimit).
        max_processes: processes and threads the call may have at once.
        output_bytes: what is kept of stdout and of stderr each; the rest is read and dropped.
        file_mb: the largest file the call may write (an rlimit on each of its processes).
        python: the interpreter that runs the code (this one by default).
    """

    timeout_s: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    output_bytes: int = 4096
    file_mb: int = 64
    python: str = sys.executable


@dataclass
class SandboxResult:
    """How a call ended. `status`: ok (exit 0), error (a nonzero exit: the traceback is in
    stderr), timeout (killed at the wall-clock limit), memory (over its memory limit)."""

    status: Status
    stdout: str
    stderr: str
    exit_code: int | None
    truncated: bool
    seconds: float


class Sandbox:
    """Runs code under `SandboxConfig`'s limits, one process (tree) per call; calls may run
    concurrently."""

    def __init__(self, cfg: SandboxConfig | None = None) -> None:
        self.cfg = cfg or SandboxConfig()
        self._bwrap = shutil.which("bwrap")
        self._cgroups = _cgroup_kind()

    def guarantees(self) -> dict[str, bool]:
        """Which limits hold here: the wall-clock limit and output cut always do."""
        isolated = self._bwrap is not None
        capped = self._cgroups is not None
        return {
            "timeout": True,
            "output": True,
            "no_network": isolated,
            "read_only_files": isolated,
            "kill_all_descendants": isolated or capped,
            "memory_total": capped,
            "processes": capped,
        }

    async def run(self, code: str) -> SandboxResult:
        """Runs `code` as a script and returns how it ended; never raises for what the code
        does."""
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="forge-sandbox-") as folder:
            script = Path(folder) / "main.py"
            script.write_text(code)
            group = self._group()
            try:
                proc = await self._start(script, group)
                out, err, timed_out = await self._wait(proc, group)
            finally:
                oom = group.close() if group else False
        return self._result(proc.returncode, out, err, timed_out, oom, time.monotonic() - start)

    def _group(self) -> "_Cgroup | None":
        """A cgroup for one call, or None where forge may not make one (then rlimits)."""
        if self._cgroups is None:
            return None
        try:
            return _Cgroup.create(self._cgroups, self.cfg)
        except OSError as e:  # e.g. a cgroup v2 root whose pids/memory controllers are off
            logger.warning("sandbox: no cgroup (%s); rlimits from now on", e)
            self._cgroups = None
            return None

    async def _start(self, script: Path, group: "_Cgroup | None") -> asyncio.subprocess.Process:
        command = [self.cfg.python, "-I", "-B", str(script)]
        if self._bwrap:
            command = [*self._isolation(script.parent), *command]
        # rlimits, set by a command rather than in the child (this process has threads). No
        # process limit: RLIMIT_NPROC counts every process of the user, not the call's.
        limits = [f"--fsize={self.cfg.file_mb << 20}"]
        if group is None:
            limits.append(f"--as={self.cfg.memory_mb << 20}")
        command = ["prlimit", *limits, "--", *command]
        if group:  # the shell joins the cgroup, then becomes the call: every child inherits it
            joins = " && ".join(f"echo $$ > {procs}" for procs in group.procs)
            command = ["sh", "-c", f'{joins} && exec "$@"', "sh", *command]
        return await asyncio.create_subprocess_exec(
            *command,
            cwd=script.parent,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # killpg reaches what it starts, namespaces or not
            env={
                "PATH": os.defpath,
                "HOME": str(script.parent),
                "TMPDIR": str(script.parent),
            },
        )

    def _isolation(self, folder: Path) -> list[str]:
        return [
            self._bwrap,
            # No tmpfs over /tmp: the interpreter itself may live there (a venv in a clone).
            *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"),
            *("--bind", str(folder), str(folder), "--chdir", str(folder)),
            *("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"),
            *("--die-with-parent", "--new-session"),
        ]

    async def _wait(
        self, proc: asyncio.subprocess.Process, group: "_Cgroup | None"
    ) -> tuple[bytes, bytes, bool]:
        cap = self.cfg.output_bytes
        reads = asyncio.gather(_read_capped(proc.stdout, cap), _read_capped(proc.stderr, -cap))
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                out, err = await asyncio.shield(reads)  # a timeout leaves the reads going
                await proc.wait()
            return out, err, False
        except TimeoutError:
            await _end(proc, group)
            try:  # the pipes close with the last process holding them
                async with asyncio.timeout(1.0):
                    out, err = await reads
            except TimeoutError:  # one left the session, with no namespace or cgroup to end it
                reads.cancel()
                out, err = b"", b""
            return out, err, True
        except BaseException:  # cancelled (a caller's deadline): the code ends too
            reads.cancel()
            await asyncio.shield(_end(proc, group))
            raise

    def _result(
        self, code: int | None, out: bytes, err: bytes, timed_out: bool, oom: bool, seconds: float
    ) -> SandboxResult:
        cap = self.cfg.output_bytes
        truncated = len(out) > cap or len(err) > cap
        stdout = out[:cap].decode(errors="replace")
        stderr = err[-cap:].decode(errors="replace")  # a traceback ends with the error
        if timed_out:
            status: Status = "timeout"
        elif oom or "MemoryError" in stderr:
            status = "memory"
        else:
            status = "ok" if code == 0 else "error"
        return SandboxResult(status, stdout, stderr, code, truncated, seconds)


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    """The first `cap` bytes (the last `-cap` if negative) and one more, to tell that there was
    more; the rest is read and dropped."""
    kept = bytearray()
    while chunk := await stream.read(_CHUNK):
        if cap >= 0 and len(kept) <= cap:
            kept += chunk[: cap + 1 - len(kept)]
        elif cap < 0:
            kept = (kept + chunk)[cap - 1 :]
    return bytes(kept)


async def _end(proc: asyncio.subprocess.Process, group: "_Cgroup | None") -> None:
    """Kills the call's session and cgroup, and waits for its first process."""
    _kill_session(proc.pid)
    if group:
        group.kill()
    await proc.wait()


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cgroup_kind() -> Literal["v1", "v2"] | None:
    """The cgroup layout forge may create sandbox groups in, if any."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        kind, probe = "v2", _parent_cgroup(None)
    elif (CGROUP_ROOT / "pids").is_dir() and (CGROUP_ROOT / "memory").is_dir():
        kind, probe = "v1", _parent_cgroup("pids")
    else:
        return None
    return kind if os.access(probe, os.W_OK) else None


def _parent_cgroup(controller: str | None) -> Path:
    """The cgroup folder a sandbox's groups are made in: inside this process's own group, so
    that the limits of whatever runs forge (a SLURM job, a systemd unit) bound the sandboxed
    code too.

    v1: this process's group in `controller`'s hierarchy. v2: the nearest group, from this
    process's own upwards, that hands the pids and memory controllers to its children (v2 lets
    only a group with no processes of its own do so; SLURM's job step is one, its tasks sit in
    a child). Where this process's group is not visible here (a container that sees its own
    group as the root), the hierarchy's root.
    """
    root = CGROUP_ROOT if controller is None else CGROUP_ROOT / controller
    wanted = controller or ""  # v2's line names no controller: "0::/path"
    lines = (line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines())
    path = next((path for _, names, path in lines if wanted in names.split(",")), "/")
    own = root / path.lstrip("/")
    if not own.is_dir():
        return root
    if controller is not None:
        return own
    for group in (own, *own.parents):
        handed = (group / "cgroup.subtree_control").read_text().split()
        if group == root or {"pids", "memory"} <= set(handed):
            return group
    return root


class _Cgroup:
    """One call's cgroup (a folder per controller in v1, one in v2): its processes and memory
    capped; killed and removed at the end."""

    def __init__(self, folders: list[Path], oom_events: Path) -> None:
        self.folders, self._oom_events = folders, oom_events
        self.procs = [folder / "cgroup.procs" for folder in folders]

    @classmethod
    def create(cls, kind: Literal["v1", "v2"], cfg: SandboxConfig) -> "_Cgroup":
        name = f"forge-sandbox-{uuid.uuid4().hex[:12]}"
        if kind == "v2":
            pids = mem = _parent_cgroup(None) / name
            group = cls([pids], mem / "memory.events")
            limits = {"pids.max": pids, "memory.max": mem, "memory.swap.max": mem}
        else:
            pids, mem = _parent_cgroup("pids") / name, _parent_cgroup("memory") / name
            group = cls([pids, mem], mem / "memory.oom_control")
            limits = {"pids.max": pids, "memory.limit_in_bytes": mem}
            if (mem.parent / "memory.memsw.limit_in_bytes").exists():  # swap counted too
                limits["memory.memsw.limit_in_bytes"] = mem
        try:
            for folder in group.folders:
                folder.mkdir()
            for limit, folder in limits.items():
                if limit == "memory.swap.max" and not (folder / limit).exists():
                    continue  # swap not accounted here
                value = cfg.max_processes if limit == "pids.max" else cfg.memory_mb << 20
                (folder / limit).write_text(str(0 if limit == "memory.swap.max" else value))
        except OSError:
            for folder in group.folders:
                if folder.exists():
                    folder.rmdir()
            raise
        return group

    def kill(self) -> None:
        """Kills every process in the group, until none is left (a bounded wait)."""
        for procs in self.procs:
            for _ in range(500):
                pids = [int(p) for p in procs.read_text().split()]
                if not pids:
                    break
                for pid in pids:
                    _kill(pid)
                time.sleep(0.01)

    def close(self) -> bool:
        """Kills whatever is left, removes the group; whether the memory limit killed any of
        its processes. A group the kernel will not remove yet is logged, not raised."""
        self.kill()
        events = dict(line.split() for line in self._oom_events.read_text().splitlines())
        for folder in self.folders:
            for attempt in range(100):
                try:
                    folder.rmdir()
                    break
                except OSError as e:  # EBUSY while its last tasks exit
                    if attempt == 99:
                        logger.warning("sandbox: cgroup %s left behind: %s", folder, e)
                    time.sleep(0.01)
        return int(events.get("oom_kill", 0)) > 0


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
