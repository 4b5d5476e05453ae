"""The files of one attempt directory, shared by the daemon (writer of attempt.json) and the
runner (writer of the rest). No torch here: the daemon imports it.

    attempt.json    what to run: the job, the plan, the workdir, the device (jobs/device.py)
    outcome.json    how it ended (strategies.outcome.Outcome)
    heartbeat.json  the latest step, loss, samples/s and memory, rewritten about once a second
    metrics.jsonl   one line per optimizer step
    output.log      the runner's stdout and stderr: its first bytes, when it is long (then
                    output.tail.log.1 and output.tail.log hold its end: daemon/log_cap.py)
    schedules.json  a command job's learning-rate schedules (jobs/bootstrap/oomguard_accelerate.py)
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from oomguard.jobs.device import DeviceSpec
from oomguard.strategies.errors import UnsafeFolder

if TYPE_CHECKING:  # imported where an attempt.json is read: `oomguard status` reads heartbeats only
    from oomguard.jobs.spec import JobSpec
    from oomguard.strategies.outcome import Phase
    from oomguard.strategies.plan import Plan
    from oomguard.strategies.step_up_history import StepUpHistory

CONFIG = "attempt.json"
OUTCOME = "outcome.json"
HEARTBEAT = "heartbeat.json"
METRICS = "metrics.jsonl"
LOG = "output.log"
# A long log's end (daemon/log_cap.py): output.log keeps the first bytes and says where the
# rest goes; the newest output is in LOG_TAIL, the segment before it in LOG_TAIL_OLDER, and
# LOG_DROPPED counts the bytes between the head and them that no file holds any more.
LOG_TAIL = "output.tail.log"
LOG_TAIL_OLDER = "output.tail.log.1"
LOG_DROPPED = "output.dropped.json"
SCHEDULES = "schedules.json"


@dataclass(frozen=True)
class AttemptConfig:
    job: JobSpec
    plan: Plan
    number: int
    workdir: Path
    # The device it trains on: the real one, or an emulated capacity (decided by the daemon
    # when it starts the attempt).
    device: DeviceSpec = DeviceSpec()
    # Measure before training (the job's first attempt, when its ladder.probe is on).
    probe: bool = False
    # Take the rungs that need no restart inside the process after an OOM in forward or
    # backward. Off only for benchmarks that time one fixed plan.
    recover_in_process: bool = True
    # What the job's earlier attempts tell this one to step back up (a built-in job's; None:
    # its first attempt, or a runner started by hand).
    step_up: StepUpHistory | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job.to_dict(),
            "plan": self.plan.to_dict(),
            "number": self.number,
            "workdir": str(self.workdir),
            "device": self.device.to_dict(),
            "probe": self.probe,
            "recover_in_process": self.recover_in_process,
            "step_up": self.step_up.to_dict() if self.step_up is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttemptConfig:
        from oomguard.jobs.spec import JobSpec
        from oomguard.strategies.plan import Plan
        from oomguard.strategies.step_up_history import StepUpHistory

        step_up = data.get("step_up")
        return cls(
            job=JobSpec.load(data["job"]),
            plan=Plan.from_dict(data["plan"]),
            number=int(data["number"]),
            workdir=Path(data["workdir"]),
            device=_device_of(data),
            probe=bool(data.get("probe", False)),
            recover_in_process=bool(data.get("recover_in_process", True)),
            step_up=StepUpHistory.from_dict(step_up) if step_up else None,
        )

    def write(self, attempt_dir: Path) -> None:
        attempt_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(attempt_dir / CONFIG, self.to_dict())

    @classmethod
    def read(cls, attempt_dir: Path) -> AttemptConfig:
        return cls.from_dict(json.loads((attempt_dir / CONFIG).read_text()))


def _device_of(data: dict[str, Any]) -> DeviceSpec:
    # An attempt.json written before "device" existed held the CapSchedule text in
    # "emulate_device_memory": attempts started before an upgrade are adopted and resumed.
    if "device" in data:
        return DeviceSpec.from_dict(data["device"])
    return DeviceSpec.from_option(data.get("emulate_device_memory"))


def write_json_atomic(path: Path, data: Any, mode: int | None = None) -> None:
    """Readers (the daemon, `oomguard show`) see the old file or the new one, never half.
    ``mode``: the file's permissions whatever the writer's umask (others must read it)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=2))
    if mode is not None:
        temporary.chmod(mode)
    temporary.replace(path)


# Larger than any attempt file oomguard writes; a bigger one is not ours to parse.
MAX_JSON_BYTES = 16 * 2**20


def open_regular(path: Path) -> BinaryIO:
    """Open a file for reading the way a daemon running as root must open files in a user's
    folder: never through a symbolic link (the user could point it anywhere), and only a
    regular file (a FIFO would block the daemon, a device might never end). OSError otherwise."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    handle = os.fdopen(descriptor, "rb")
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        handle.close()
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return handle


def read_json(path: Path) -> Any | None:
    """The JSON in ``path``; None when it is missing, unreadable, not a regular file or not
    (yet) whole JSON: callers treat all of these as "nothing reported"."""
    try:
        with open_regular(path) as handle:
            return _json_of(handle)
    except OSError:
        return None


def _json_of(handle: BinaryIO) -> Any | None:
    data = handle.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


# Reading a user's folder as root ----------------------------------------------------------
#
# A path names a folder only until someone renames or replaces a folder on it. A user who owns
# a folder on the way to their workdir (or the workdir itself) can swap it for a symbolic link
# into another user's folders at any time, and root, which may enter every folder, would read
# that user's files as theirs. So the daemon never reads an attempt's files by path: it opens
# the folder once, one component at a time without following a link that a user could have
# made (only links owned by root, or by the process's own user, are followed; never the last
# component), checks that the workdir, attempts/ and the attempt's folder belong to the job's
# owner, and opens each file relative to that descriptor (openat), again without following a
# link and only if it is a regular file of the owner. A swapped folder then reads as nothing.

_FOLDER_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40


def open_folder(path: Path, owner_uid: int | None = None) -> int:
    """An O_PATH descriptor of the folder ``path`` (absolute), opened from / one component at a
    time: a symbolic link on the way is followed only when root or this process's user owns it
    (its target read with readlinkat and walked the same way), the last component never; with
    ``owner_uid``, the folder must belong to that uid. Raises UnsafeFolder (or the OSError of a
    missing folder); the caller closes the descriptor."""
    path = Path(path)
    if not path.is_absolute():
        raise ValueError(f"{path} is not an absolute path")
    trusted = {0, os.geteuid()}
    # A stack, the next component last: (name, whether it is one of ``path``'s own).
    todo = [(name, True) for name in reversed(path.parts[1:])]
    own_left = len(todo)
    descriptor = os.open("/", _FOLDER_FLAGS)
    where = Path("/")
    links = 0
    try:
        while todo:
            name, own = todo.pop()
            own_left -= own
            final = own and own_left == 0  # the folder itself: never through a link
            if name in ("", "."):
                continue
            try:
                following = os.open(name, _FOLDER_FLAGS, dir_fd=descriptor)
            except OSError as error:
                if error.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                st = os.stat(name, dir_fd=descriptor, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise UnsafeFolder(errno.ENOTDIR, "not a folder", str(where / name)) from None
                if final or st.st_uid not in trusted:
                    raise UnsafeFolder(errno.ELOOP, f"a symbolic link (owned by uid {st.st_uid})", str(where / name)) from None
                links += 1
                if links > _MAX_LINKS:
                    raise UnsafeFolder(errno.ELOOP, "too many symbolic links", str(path)) from None
                target = Path(os.readlink(name, dir_fd=descriptor))
                if target.is_absolute():
                    os.close(descriptor)
                    descriptor, where = os.open("/", _FOLDER_FLAGS), Path("/")
                todo.extend((part, False) for part in reversed(target.parts[1:] if target.is_absolute() else target.parts))
                continue
            os.close(descriptor)
            descriptor = following
            where = where.parent if name == ".." else where / name
        if owner_uid is not None:
            st = os.fstat(descriptor)
            if st.st_uid != owner_uid:
                raise UnsafeFolder(errno.EPERM, f"belongs to uid {st.st_uid}, not uid {owner_uid}", str(path))
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


class AttemptFiles:
    """The files of one attempt folder, each opened relative to one descriptor of the folder
    without following a link, and only as a regular file (``open``, ``read_json``, ``mtime``).

    ``AttemptFiles.owned_by(folder, uid)`` is how a daemon running as root reads a user's
    attempt (see open_folder): when the folder cannot be opened that way, ``problem`` says so in
    words that are the same whatever the reason (a user must not learn from it what lies behind
    a folder of someone else's), and every file reads as missing. ``AttemptFiles(path)`` opens
    the folder as it is named, for a process that reads its own user's attempt (the CLI, the
    runner, tests); it holds no descriptor. Use owned_by's as a context manager, or close() it."""

    def __init__(self, path: Path, descriptor: int | None = None, problem: str | None = None, file_owner: int | None = None) -> None:
        self.path = Path(path)
        self.problem = problem
        self._file_owner = file_owner
        self._descriptor = descriptor

    @classmethod
    def owned_by(cls, attempt_dir: Path, owner_uid: int, owner_name: str | None = None) -> AttemptFiles:
        """``attempt_dir`` is WORKDIR/attempts/NNN: the workdir is opened with open_folder,
        attempts/ and NNN below it without following a link; all three, and every file read,
        must belong to ``owner_uid``."""
        attempt_dir = Path(attempt_dir)
        descriptor: int | None = None
        try:
            descriptor = open_folder(attempt_dir.parent.parent, owner_uid)
            for name in (attempt_dir.parent.name, attempt_dir.name):
                below = os.open(name, _FOLDER_FLAGS, dir_fd=descriptor)
                os.close(descriptor)
                descriptor = below
                if os.fstat(descriptor).st_uid != owner_uid:
                    raise UnsafeFolder(errno.EPERM, "not the owner's", str(attempt_dir))
        except (OSError, ValueError):
            if descriptor is not None:
                os.close(descriptor)
            who = owner_name or f"uid {owner_uid}"
            return cls(attempt_dir, problem=(
                f"its folder {attempt_dir} cannot be opened as {who}'s without following a symbolic link (a folder on its "
                f"path is missing, was replaced by a link, or belongs to someone else), so oomguard read nothing of what it "
                f"reported; keep the workdir and the folders above it real folders (no links {who} can change), and submit the job again"
            ))
        return cls(attempt_dir, descriptor, file_owner=owner_uid)

    def open(self, name: str) -> BinaryIO:
        """The file ``name`` of the folder, for reading: never through a link, only a regular
        file (a FIFO would block a daemon, a device might never end) and, for a folder opened
        with owned_by, only one of its owner's. OSError otherwise."""
        if self._descriptor is None:
            if self.problem is not None:
                raise UnsafeFolder(errno.ENOENT, self.problem, str(self.path / name))
            return open_regular(self.path / name)  # AttemptFiles(path): its own user reads it
        descriptor = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self._descriptor)
        handle = os.fdopen(descriptor, "rb")
        st = os.fstat(descriptor)
        if not stat.S_ISREG(st.st_mode) or (self._file_owner is not None and st.st_uid != self._file_owner):
            handle.close()
            raise OSError(errno.EINVAL, "not a regular file of the attempt's owner", str(self.path / name))
        return handle

    def read_json(self, name: str) -> Any | None:
        """Like read_json: None for whatever cannot be read as whole JSON."""
        try:
            with self.open(name) as handle:
                return _json_of(handle)
        except OSError:
            return None

    def mtime(self, name: str) -> float | None:
        """When the file ``name`` was last written; None when it is not there (or not readable)."""
        try:
            with self.open(name) as handle:
                return os.fstat(handle.fileno()).st_mtime
        except OSError:
            return None

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None

    def __enter__(self) -> AttemptFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attempt_files(folder: Path | AttemptFiles) -> AttemptFiles:
    """``folder`` as AttemptFiles: a path is opened as it is named (its own user reads it)."""
    return folder if isinstance(folder, AttemptFiles) else AttemptFiles(folder)


def read_log_end(folder: Path | AttemptFiles, max_bytes: int) -> str:
    """The last ``max_bytes`` of an attempt's output (from its first whole line when there was
    more), where what it died of is: the end of output.log, or, once a long log goes on in its
    tail files, of output.tail.log.1 and output.tail.log joined (the head's end only while the
    tail has not been rotated: after that, output is missing between them). Missing files read
    as empty; OSError when one cannot be read."""
    files = attempt_files(folder)
    pieces: list[bytes] = []
    wanted = max_bytes
    rotated = False
    more = False  # output came before what was read
    for name in (LOG_TAIL, LOG_TAIL_OLDER, LOG):
        if name == LOG and rotated:
            more = True
            break
        try:
            handle = files.open(name)
        except FileNotFoundError:
            continue
        rotated = rotated or name == LOG_TAIL_OLDER
        with handle:
            size = os.fstat(handle.fileno()).st_size
            taken = min(size, wanted)
            handle.seek(size - taken)
            pieces.append(handle.read(taken))
        wanted -= len(pieces[-1])
        if taken < size:
            more = True
            break
    text = b"".join(reversed(pieces)).decode("utf-8", errors="replace")
    return text.partition("\n")[2] if more else text


@dataclass
class Control:
    """Shared between the training loop and the runner's SIGTERM and SIGUSR1 handlers."""

    stop_requested: bool = False
    # The stop is for a batch scheduler's time limit (SIGUSR1), received at this time.monotonic().
    time_limit_signal_at: float | None = None
    phase: Phase = "setup"
