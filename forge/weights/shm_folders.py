"""forge's folders in shared memory, each marked with the process that owns it.

Shared memory outlives processes: a file left in /dev/shm holds RAM until reboot. So every
folder forge makes there is `/dev/shm/forge-<name>` with an `owner.json` naming its owner (pid
and start time, so a reused pid is not mistaken for it). The owner removes the folder when it
ends; a folder whose owner died without doing so (SIGKILL) is removed by the next run's start
or by `forge clean` (`remove_dead`). Folders without a marker are not forge's to remove.

A run's folder is named after its run folder (`run_folder`), and the shm weight transport of a
run that leaves `weight_sync.transport.path` unset lives in it (`claim_for_run`).
"""

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from forge.controller import get_provisioner
from forge.weights.transport import TransportConfig

SHM_ROOT = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
PREFIX = "forge-"
MARKER = "owner.json"


def started(pid: int) -> float | None:
    """Seconds from boot to `pid`'s start (/proc/<pid>/stat), None if no such process runs
    (a zombie does not).

    Not psutil's create_time: that adds the boot time, which the kernel derives from the wall
    clock, so after a clock adjustment (NTP) another process sees the same start a second
    apart, and a live owner's folder would be taken for a dead one's.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # After the command name, which may hold spaces, parentheses and bytes of any encoding.
    fields = stat[stat.rindex(b")") + 2 :].split()
    state, start_ticks = fields[0], int(fields[19])  # stat fields 3 and 22
    return None if state == b"Z" else start_ticks / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Owner:
    """A process, told apart from a later one that reuses its pid by its start time."""

    pid: int
    started: float  # `started(pid)`: seconds from boot, the same from any process
    what: str = ""  # for people reading the marker: "run /abs/run_dir", "generator staging"

    @classmethod
    def of(cls, pid: int, what: str = "") -> "Owner":
        """The running process `pid`."""
        start = started(pid)
        if start is None:
            raise ProcessLookupError(f"no process {pid}")
        return cls(pid, start, what)

    @classmethod
    def this_process(cls, what: str = "") -> "Owner":
        return cls.of(os.getpid(), what)

    def alive(self) -> bool:
        return started(self.pid) == self.started


def owner_of(folder: Path) -> Owner | None:
    """The owner named by `folder`'s marker; None if it has none (or an unreadable one)."""
    try:
        return Owner(**json.loads((folder / MARKER).read_text()))
    except (OSError, ValueError, TypeError):
        return None


class ShmFolder:
    """A folder in shared memory owned by this process; `remove()` (or the provisioner's
    `shutdown()`, once registered with `own()`) gives its memory back."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str, what: str = "", root: Path = SHM_ROOT) -> "ShmFolder":
        """Makes `<root>/forge-<name>` owned by this process.

        A folder of that name left by a dead owner is removed first; one of this process is
        reused. Raises RuntimeError if a live process owns it.
        """
        path = root / f"{PREFIX}{name}"
        owner = owner_of(path)
        if owner is not None and owner.pid != os.getpid() and owner.alive():
            raise RuntimeError(
                f"{path} belongs to a running process (pid {owner.pid}, {owner.what}): "
                "two runs cannot share one run folder"
            )
        if owner is not None and owner.pid != os.getpid():
            shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f"{MARKER}.{uuid.uuid4().hex}"
        tmp.write_text(json.dumps(dataclasses.asdict(Owner.this_process(what))))
        os.replace(tmp, path / MARKER)  # a reader sees a whole marker or none
        return cls(path)

    def remove(self) -> None:
        """Removes the folder and everything in it (mapped files live on until unmapped)."""
        shutil.rmtree(self.path, ignore_errors=True)

    async def shutdown(self) -> None:
        """`remove()`, for the provisioner (`get_provisioner().own(folder)`)."""
        self.remove()


def remove_dead(root: Path = SHM_ROOT) -> list[tuple[Path, Owner, int]]:
    """Removes every forge folder under `root` whose owner is dead.

    Returns (folder, owner, bytes freed) for each.
    """
    return _remove_where(root, lambda owner: not owner.alive())


def remove_own(root: Path = SHM_ROOT) -> list[tuple[Path, Owner, int]]:
    """Removes every forge folder under `root` that this process owns (one about to end
    without its clean-up); returns (folder, owner, bytes freed) for each."""
    return _remove_where(root, lambda owner: owner.pid == os.getpid())


def _remove_where(root: Path, doomed: Callable[[Owner], bool]) -> list[tuple[Path, Owner, int]]:
    removed = []
    for folder in sorted(root.glob(f"{PREFIX}*")):
        owner = owner_of(folder)
        if owner is not None and doomed(owner):
            size = folder_bytes(folder)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append((folder, owner, size))
    return removed


def folder_bytes(folder: Path) -> int:
    """The bytes the files under `folder` hold; 0 for one another process removes meanwhile
    (two runs ending together each remove dead processes' folders)."""
    try:
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    except FileNotFoundError:
        return 0


def run_folder(run_dir: str | Path, root: Path = SHM_ROOT) -> Path:
    """The shared-memory folder of the run in `run_dir`: named by a hash of its absolute path,
    so any run_dir (relative, absolute, nested) gives one flat, unique name."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return root / f"{PREFIX}run-{digest}"


def claim_for_run(run_dir: str | Path, transport: TransportConfig) -> ShmFolder:
    """Gives a run its shared-memory folder, removed at `forge.controller.shutdown()`.

    Call it in the run's driver after `init_provisioner` and before spawning actors: it removes
    dead runs' folders, makes `run_folder(run_dir)` owned by this process, and points the run's
    `transport` (weight_sync.transport), if it is shm and leaves `path` unset, at
    `<folder>/weights`. Raises RuntimeError if a live run holds the same run folder.
    """
    remove_dead()
    path = run_folder(run_dir)
    folder = ShmFolder.create(path.name.removeprefix(PREFIX), f"run {Path(run_dir).resolve()}")
    get_provisioner().own(folder)
    if transport.kind == "shm" and transport.path is None:
        transport.path = str(folder.path / "weights")
    return folder
