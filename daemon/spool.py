"""The spool: job files arrive in ``inbox/``; the daemon validates each one, records it and
moves it to ``accepted/``, or moves it to ``rejected/`` beside a ``.error`` file that says
what is wrong. A bad file never stops the daemon.

``oomguard submit`` writes into the inbox under a hidden temporary name and renames it, so the
daemon never reads half a file; it also puts a first line ``# oomguard-base-dir: DIR`` in the
copy, so relative paths in the job still mean what they meant next to the original file.
Files dropped in by hand are treated the same way (their relative paths are taken from the
inbox).

A job belongs to the owner of its inbox file (daemon/users.py explains why that is trusted).
Files named ``*.request`` are requests about existing jobs (``oomguard cancel``): the daemon
answers them in the store, checking the requester (the file's owner) may change that job.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import FileClosedEvent, FileMovedEvent, FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from oomguard.daemon.users import Account, PermissionRefused, read_owned_file
from oomguard.jobs.spec import JobFileError, JobSpec, parse_job_text

BASE_DIR_HEADER = "# oomguard-base-dir: "
# A file found by the periodic rescan (not by an event) is read only once it is this old, so a
# file being copied in by hand is not read half-written.
SETTLE_SECONDS = 2.0


REQUEST_SUFFIX = ".request"


def spool_text(job_file: Path) -> str:
    """The inbox copy of a job file: its text under a header naming its folder."""
    return f"{BASE_DIR_HEADER}{job_file.resolve().parent}\n{job_file.read_text(encoding='utf-8')}"


def write_to_inbox(inbox: Path, stem: str, text: str, suffix: str = ".toml") -> Path:
    """Atomically place ``text`` in the inbox under a unique name; returns its final path.
    The file is readable by its owner only: on a shared box others may guess its name."""
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{stem}"
    temporary = inbox / f".{stem}.tmp"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    final = inbox / f"{stem}{suffix}"
    os.replace(temporary, final)
    return final


def request_text(action: str, job: str) -> str:
    return json.dumps({"action": action, "job": job})


def parse_spooled(path: Path, display_name: str | None = None, text: str | None = None) -> JobSpec:
    """Validate an inbox file (or its ``text``, read already); errors name the job by
    ``display_name`` (the user's file name)."""
    if text is None:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise JobFileError(display_name or path.name, None, f"not valid UTF-8 text ({error.reason})") from None
    base_dir = path.parent
    if text.startswith(BASE_DIR_HEADER):
        # Drop the header so that line numbers in TOML errors match the user's file.
        first_line, _, text = text.partition("\n")
        base_dir = Path(first_line[len(BASE_DIR_HEADER):].strip())
    return parse_job_text(text, display_name or path.name, base_dir=base_dir)


@dataclass(frozen=True)
class Arrival:
    """A job file that passed validation and now waits in accepted/."""

    spec: JobSpec
    owner: Account
    spool_file: str


@dataclass(frozen=True)
class Request:
    """A user's request about a job (``*.request`` in the inbox)."""

    requester: Account
    action: str
    job: str
    spool_file: str


@dataclass(frozen=True)
class Rejection:
    file: str
    error: str


class _Handler(FileSystemEventHandler):
    def __init__(self, ready: queue.Queue[Path], inbox: Path) -> None:
        self.ready = ready
        self.inbox = inbox

    def on_closed(self, event: FileClosedEvent) -> None:
        self._offer(str(event.src_path))

    def on_moved(self, event: FileMovedEvent) -> None:
        self._offer(str(event.dest_path))

    def _offer(self, path_text: str) -> None:
        path = Path(path_text)
        if path.parent == self.inbox and not path.name.startswith("."):
            self.ready.put(path)

    def on_any_event(self, event: FileSystemEvent) -> None:
        return None


class Spool:
    """Watches the inbox (watchdog, acting on close and on move, never on create)."""

    def __init__(self, inbox: Path, accepted: Path, rejected: Path, rescan_seconds: float = 10.0) -> None:
        self.inbox, self.accepted, self.rejected = inbox, accepted, rejected
        self.rescan_seconds = rescan_seconds
        self._ready: queue.Queue[Path] = queue.Queue()
        self._observer = Observer()
        self._observer.schedule(_Handler(self._ready, inbox.resolve()), str(inbox.resolve()), recursive=False)
        self._last_scan = 0.0

    def start(self) -> None:
        self._observer.start()
        # Files that arrived while no daemon was watching.
        self._scan(settled_only=False)

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)

    def _scan(self, settled_only: bool) -> None:
        self._last_scan = time.monotonic()
        now = time.time()
        inbox = self.inbox.resolve()
        with os.scandir(inbox) as entries:
            names = sorted(entry.name for entry in entries if not entry.name.startswith(".") and not entry.is_dir(follow_symlinks=False))
        for name in names:
            # Never resolved: a symbolic link is offered as itself, and refused by take().
            path = inbox / name
            try:
                if settled_only and now - os.lstat(path).st_mtime < SETTLE_SECONDS:
                    continue
            except FileNotFoundError:
                continue  # taken back by its owner meanwhile
            self._ready.put(path)

    def pending(self) -> list[Path]:
        """Inbox files to look at now (each at most once; missing ones are dropped)."""
        # The rescan is a safety net for events the observer missed (e.g. an overflowed
        # inotify queue); watchdog normally reports a file within milliseconds.
        if time.monotonic() - self._last_scan >= self.rescan_seconds:
            self._scan(settled_only=True)
        seen: list[Path] = []
        while True:
            try:
                path = self._ready.get_nowait()
            except queue.Empty:
                break
            if path not in seen and os.path.lexists(path):
                seen.append(path)
        return seen

    def take(self, path: Path) -> Arrival | Request | Rejection:
        """Validate one inbox file; a bad one is moved out of the inbox at once."""
        if path.parent != self.inbox.resolve():
            raise ValueError(f"{path} is not in the inbox {self.inbox}")
        try:
            # Owner and content from one open file: it cannot be swapped in between.
            owner, raw = read_owned_file(path)
        except (PermissionRefused, OSError) as error:
            return self.reject(path, str(error))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            return self.reject(path, f"{path.name}: not valid UTF-8 text ({error.reason})")
        if path.name.endswith(REQUEST_SUFFIX):
            try:
                data = json.loads(text)
                return Request(requester=owner, action=str(data["action"]), job=str(data["job"]), spool_file=path.name)
            except (ValueError, KeyError, TypeError):
                return self.reject(path, f"{path.name}: not a request (expected JSON with action and job; `oomguard cancel` writes them)")
        try:
            spec = parse_spooled(path, text=text)
        except JobFileError as error:
            return self.reject(path, str(error))
        return Arrival(spec=spec, owner=owner, spool_file=path.name)

    def consume(self, path: Path) -> None:
        """A request that has been answered (the answer is in the store)."""
        path.unlink(missing_ok=True)

    def accept(self, path: Path, job_id: int) -> Path:
        destination = self.accepted / f"{job_id:06d}-{path.name}"
        shutil.move(str(path), destination)
        return destination

    def reject(self, path: Path, error: str) -> Rejection:
        destination = self.rejected / path.name
        shutil.move(str(path), destination)
        destination.with_name(destination.name + ".error").write_text(error + "\n")
        return Rejection(file=path.name, error=error)
