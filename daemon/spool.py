"""The spool: job files arrive in ``inbox/``; the daemon validates each one, records it and
moves it to ``accepted/``, or moves it to ``rejected/`` beside a ``.error`` file that says
what is wrong. A bad file never stops the daemon.

``oomguard submit`` writes into the inbox under a hidden temporary name and renames it, so the
daemon never reads half a file, with header lines that say where the job file was and where it
was submitted from (daemon/inbox.py: what the CLI writes there, and how).
Files dropped in by hand are treated the same way (their relative paths are taken from the
inbox).

A job belongs to the owner of its inbox file (daemon/users.py explains why that is trusted).
Files named ``*.request`` are requests about existing jobs (``oomguard cancel``): the daemon
answers them in the store, checking the requester (the file's owner) may change that job.

*Names are unguessable.* The CLI finds the daemon's answer (the job it queued, the answer to a
request) in the shared store by the name of the file it wrote, so nobody else may be able to
use that name first. Names were once time-pid-stem: another user made 1,200 files under the
names a submit would use soon, the daemon recorded them as his jobs, and when the victim's file
came under one of those names her CLI reported his job as hers (and hers was never created).
Now each name carries 128 random bits (inbox.py :func:`write_to_inbox`), both the temporary and the
final name are created without following or replacing anything already there (a name taken
makes the CLI pick another one), the daemon takes a file under a name it has recorded before
only from the same owner (the crash between recording and moving), and the CLI reports only an
answer recorded for its own uid.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import FileClosedEvent, FileMovedEvent, FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from oomguard.daemon.inbox import BASE_DIR_HEADER, SUBMIT_DIR_HEADER, job_key_problem, parse_spooled
from oomguard.daemon.users import Account, file_owner, is_admin, read_owned_file
from oomguard.daemon.wakeup import Wakeup
from oomguard.jobs.spec import MAX_JOB_FILE_BYTES, JobSpec
from oomguard.strategies.errors import JobFileError, PermissionRefused

# A file found by the periodic rescan (not by an event) is read only once it is this old, so a
# file being copied in by hand is not read half-written.
SETTLE_SECONDS = 2.0


REQUEST_SUFFIX = ".request"
# What the spool reads of an inbox file: a job file `oomguard submit` accepted, plus the header
# line it adds (a folder path of at most PATH_MAX bytes).
READ_LIMIT = MAX_JOB_FILE_BYTES + len(BASE_DIR_HEADER) + len(SUBMIT_DIR_HEADER) + 2 * (4096 + 1)
# Inbox names longer than this are renamed before they are read: the spool adds up to 7
# characters (accepted/NNNNNN-NAME, rejected/NAME.error), and a name may have 255 bytes at most.
MAX_NAME_BYTES = 200


def safe_name(name: str) -> str | None:
    """None when ``name`` can be stored, printed and extended as it is; else a name that can:
    UTF-8, printable, at most MAX_NAME_BYTES, with the same suffix and a hash of the original.

    Why: a file named with bytes that are not UTF-8 (b"\\xff.toml") reached SQLite and the
    daemon's log as a lone surrogate and raised UnicodeEncodeError twice, the second time out of
    the daemon's loop: any user could stop the daemon by dropping such a file in the inbox. A
    255-byte name could not get its ".error" beside it in rejected/ (ENAMETOOLONG)."""
    try:
        fits = name.isprintable() and len(name.encode("utf-8")) <= MAX_NAME_BYTES
    except UnicodeEncodeError:
        fits = False
    if fits:
        return None
    raw = os.fsencode(name)
    suffix = next((end for end in (REQUEST_SUFFIX, ".toml") if name.endswith(end)), "")
    stem = raw[: len(raw) - len(suffix)].decode("utf-8", "replace")
    stem = "".join(c if c.isprintable() and c != "\ufffd" else "_" for c in stem)
    stem = stem.encode("utf-8")[:120].decode("utf-8", "ignore").lstrip(".") or "_"
    return f"{stem}-{hashlib.sha256(raw).hexdigest()[:12]}{suffix}"


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
    def __init__(self, ready: queue.Queue[Path], inbox: Path, arrived: Wakeup | None) -> None:
        self.ready = ready
        self.inbox = inbox
        self.arrived = arrived

    def on_closed(self, event: FileClosedEvent) -> None:
        self._offer(str(event.src_path))

    def on_moved(self, event: FileMovedEvent) -> None:
        self._offer(str(event.dest_path))

    def _offer(self, path_text: str) -> None:
        path = Path(path_text)
        if path.parent == self.inbox and not path.name.startswith("."):
            self.ready.put(path)
            if self.arrived is not None:
                self.arrived.set()

    def on_any_event(self, event: FileSystemEvent) -> None:
        return None


class Spool:
    """Watches the inbox (watchdog, acting on close and on move, never on create)."""

    def __init__(
        self, inbox: Path, accepted: Path, rejected: Path, rescan_seconds: float = 10.0, arrived: Wakeup | None = None,
    ) -> None:
        """``arrived``: set whenever a file is offered, so that a daemon waiting on it takes the
        file at once rather than at its next tick."""
        self.inbox, self.accepted, self.rejected = inbox, accepted, rejected
        self.rescan_seconds = rescan_seconds
        self._ready: queue.Queue[Path] = queue.Queue()
        self._observer = Observer()
        self._observer.schedule(_Handler(self._ready, inbox.resolve(), arrived), str(inbox.resolve()), recursive=False)
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
            # Directories too (a folder named x.toml): they used to stay in the inbox for ever,
            # unanswered; take() refuses them like every other file that is not a regular file.
            names = sorted(entry.name for entry in entries if not entry.name.startswith("."))
        for name in names:
            # Never resolved: a symbolic link is offered as itself, and refused by take().
            path = inbox / name
            try:
                if settled_only and now - os.lstat(path).st_mtime < SETTLE_SECONDS:
                    continue
            except FileNotFoundError:
                continue  # taken back by its owner meanwhile
            self._ready.put(path)

    def pending(self, limit: int = 200) -> list[Path]:
        """Inbox files to look at now, at most ``limit`` (the rest next time: 10,000 files
        dropped at once must not hold the daemon's loop for minutes); each at most once,
        missing ones dropped. A file whose name the daemon could not store or print is renamed
        first (:func:`safe_name`)."""
        # The rescan is a safety net for events the observer missed (e.g. an overflowed
        # inotify queue); watchdog normally reports a file within milliseconds.
        if time.monotonic() - self._last_scan >= self.rescan_seconds:
            self._scan(settled_only=True)
        seen: list[Path] = []
        while len(seen) < limit:
            try:
                path = self._ready.get_nowait()
            except queue.Empty:
                break
            if not os.path.lexists(path):
                continue
            renamed = safe_name(path.name)
            if renamed is not None:
                path = self._rename(path, renamed)
                if path is None:
                    continue
            if path not in seen:
                seen.append(path)
        return seen

    def has_pending(self) -> bool:
        """Whether files wait to be looked at (more than one pending() call took)."""
        return not self._ready.empty()

    def _rename(self, path: Path, name: str) -> Path | None:
        """``path`` renamed to ``name`` in the inbox (never over another file); None if it has gone."""
        target, number = path.with_name(name), 1
        while os.path.lexists(target):
            number += 1
            target = path.with_name(f"{number}-{name}")
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return None
        return target

    def take(self, path: Path) -> Arrival | Request | Rejection:
        """Validate one inbox file; a bad one is moved out of the inbox at once."""
        if path.parent != self.inbox.resolve():
            raise ValueError(f"{path} is not in the inbox {self.inbox}")
        try:
            # Owner and content from one open file: it cannot be swapped in between.
            owner, raw = read_owned_file(path, limit=READ_LIMIT)
        except FileNotFoundError:
            # Taken back by its owner between the event and now: nothing to read or move.
            return self.reject(path, f"{path.name}: removed from the inbox before the daemon read it; submit it again to run it")
        except PermissionRefused as error:
            return self.reject(path, str(error))
        except OSError as error:  # e.g. a socket (ENXIO): say what belongs in the inbox
            return self.reject(
                path, f"{path.name}: cannot be read ({error.strerror or error}); only job files (regular TOML files) "
                "and `oomguard cancel` requests belong in the inbox",
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            return self.reject(path, f"{path.name}: not valid UTF-8 text ({error.reason})")
        if path.name.endswith(REQUEST_SUFFIX):
            not_a_request = f"{path.name}: not a request (expected JSON with action and job; `oomguard cancel` writes them)"
            try:
                data = json.loads(text)
            except (ValueError, RecursionError):  # RecursionError: "[[[[..." a few thousand deep
                return self.reject(path, not_a_request)
            # Only strings (and a job id as a number) become a request: a list or a lone
            # surrogate ("\ud800") reached SQLite and failed there instead of being refused.
            action, job = (data.get("action"), data.get("job")) if isinstance(data, dict) else (None, None)
            if isinstance(job, int) and not isinstance(job, bool):
                job = str(job) if job >= 0 else None
            if not (isinstance(action, str) and isinstance(job, str) and _encodable(action) and _encodable(job)):
                return self.reject(path, not_a_request)
            problem = job_key_problem(job)
            if problem:
                return self.reject(path, f"{path.name}: {problem}")
            return Request(requester=owner, action=action, job=job, spool_file=path.name)
        try:
            spec = parse_spooled(path, text=text, check_files=_may_look_at_paths_for(owner), home=owner.home)
        except JobFileError as error:
            return self.reject(path, str(error))
        return Arrival(spec=spec, owner=owner, spool_file=path.name)

    def owner(self, path: Path) -> Account:
        """The owner of the inbox file ``path`` itself (never a link's target: PermissionRefused)."""
        return file_owner(path)

    def consume(self, path: Path) -> None:
        """A request that has been answered (the answer is in the store)."""
        path.unlink(missing_ok=True)

    def accept(self, path: Path, job_id: int) -> Path:
        destination = self.accepted / f"{job_id:06d}-{path.name}"
        shutil.move(str(path), destination)
        return destination

    def reject(self, path: Path, error: str) -> Rejection:
        destination = self.rejected / path.name
        # A directory (moved in as x.toml) is never moved into, or over, what rejected/
        # already holds: it gets a name of its own (x.toml.2) and so does its .error file.
        number = 1
        while (os.path.isdir(destination) or os.path.isdir(f"{destination}.error")
               or (os.path.isdir(path) and os.path.lexists(destination))):
            number += 1
            destination = self.rejected / f"{path.name}.{number}"
        try:
            shutil.move(str(path), destination)
        except FileNotFoundError:
            pass  # gone already (its owner took it back): the .error still says why it was refused
        error_file = destination.with_name(destination.name + ".error")
        error_file.write_text(error + "\n", encoding="utf-8", errors="backslashreplace")
        return Rejection(file=path.name, error=error)


def _may_look_at_paths_for(owner: Account) -> bool:
    """Whether the daemon checks the paths a job file names (its data folder; the command's
    folder, program and script) before it queues the job: only for a job of its own user.

    Run as root (system mode), the daemon sees every path; another user does not. Refusing or
    queueing their file for a path they could not look at themselves would tell them whether it
    exists. `oomguard submit` has checked those paths as that user, which is where a mistyped
    path is caught; a path that is wrong by the time an attempt starts fails the attempt, which
    runs as the owner, with its error quoted (and the same error twice ends the job)."""
    return owner.uid == os.geteuid()


# The highest priority a job may have whose owner is not root, the daemon's own user or a
# member of its admin group (`oomguard daemon --max-user-priority`). Without a cap any user could
# put every job of theirs ahead of everyone else's (priority 2**63-1).
DEFAULT_MAX_USER_PRIORITY = 100


def priority_refusal(owner: Account, priority: int, cap: int | None, admin_group: str | None, file_name: str) -> str | None:
    """Why ``owner`` may not give a job ``priority`` on a daemon whose cap is ``cap`` (None: no
    cap), or None. Root, the daemon's own user and members of ``admin_group`` may give any."""
    if cap is None or priority <= cap or owner.uid == os.geteuid() or is_admin(owner, admin_group):
        return None
    exempt = f"root and members of group {admin_group!r}" if admin_group else "root"
    return (
        f"{file_name}: priority {priority} is above {cap}, the highest this daemon lets {owner.name} give a job "
        f"(only {exempt} may go higher); set `priority` to {cap} or less in the job file and submit it again, "
        f"or ask the administrator to raise the cap (`oomguard daemon --max-user-priority N`)"
    )


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
