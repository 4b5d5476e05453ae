"""Fixtures shared by the unit tests and the end-to-end tests.

Users: the tests marked ``as_root`` create throwaway local users (ogtest-alice, -bob, -carol)
and groups (ogtest-extra, ogtest-admin) with useradd/groupadd and remove them at the end of
the session; they are skipped unless the tests run as root on a machine with useradd.
"""

from __future__ import annotations

import fcntl
import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from oomguard.daemon.paths import StateDir
from oomguard.daemon.spool import Spool
from oomguard.daemon.store import Store
from oomguard.daemon.supervisor import Supervisor
from oomguard.daemon.users import Account

_ROOT_REASON = (
    "needs root and useradd/groupadd/usermod/userdel to create throwaway users"
    if shutil.which("useradd") is None or shutil.which("groupadd") is None
    else "needs root (euid 0) to create throwaway users and run processes as them"
)
as_root = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("useradd", "userdel", "groupadd", "groupdel", "usermod")),
    reason=_ROOT_REASON,
)

ALICE, BOB, CAROL = "ogtest-alice", "ogtest-bob", "ogtest-carol"
EXTRA, ADMIN = "ogtest-extra", "ogtest-admin"


def _sh(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")


def group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


# Test sessions that run at the same time (pytest-xdist's workers, several engineers, a session
# beside CI) share the throwaway users: each holds a shared lock on the users lock while it uses
# them, and only the last one to finish (the one that can turn its lock exclusive) removes them.
# Creating and removing take a second, exclusive lock of their own: a session must not wait for
# the users lock to be free to create them (it never is while another session runs).
_USERS_LOCK = Path(tempfile.gettempdir()) / "ogtest-users.lock"
_CHANGE_LOCK = Path(tempfile.gettempdir()) / "ogtest-users-change.lock"


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    handle = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


@pytest.fixture(scope="session")
def accounts() -> Iterator[dict[str, Account]]:
    """alice (also in ogtest-extra), bob, carol (in ogtest-admin). Idempotent: users and groups
    left over from a crashed run are reused."""
    in_use = os.open(_USERS_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    with _exclusive(_CHANGE_LOCK):
        fcntl.flock(in_use, fcntl.LOCK_SH)
        for group in (EXTRA, ADMIN):
            if not group_exists(group):
                _sh("groupadd", group)
        for name in (ALICE, BOB, CAROL):
            if not user_exists(name):
                _sh("useradd", "-M", "-U", "-s", "/usr/sbin/nologin", "-d", f"/nonexistent/{name}", name)
        _sh("usermod", "-aG", EXTRA, ALICE)
        _sh("usermod", "-aG", ADMIN, CAROL)
    try:
        yield {name.removeprefix("ogtest-"): Account.from_name(name) for name in (ALICE, BOB, CAROL)}
    finally:
        with _exclusive(_CHANGE_LOCK):
            try:
                fcntl.flock(in_use, fcntl.LOCK_EX | fcntl.LOCK_NB)
                last = True
            except BlockingIOError:
                last = False  # another session still uses them: it removes them
            if last:
                for name in (ALICE, BOB, CAROL):
                    subprocess.run(["userdel", name], capture_output=True, timeout=30)
                for group in (EXTRA, ADMIN, ALICE, BOB, CAROL):  # user groups too, if userdel left them
                    if group_exists(group):
                        subprocess.run(["groupdel", group], capture_output=True, timeout=30)
            os.close(in_use)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A root-owned 0755 directory that every user can reach (pytest's tmp_path is 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="ogtest-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)



# The sessions that need others_can_run_oomguard now (pids), and the modes to give back when
# the last of them ends: pytest-xdist's workers are sessions of their own, and one that ended
# first took /root's search permission back from under the others' users (their Python then
# failed to import its own standard library halfway through a test).
GRANTS = Path(tempfile.gettempdir()) / "oomguard-tests-grants.json"


@contextmanager
def _grants() -> Iterator[dict]:
    """The shared record of grants, read and written under an exclusive lock. It lies in /tmp,
    where anyone may put a file first: one that is not ours, or that others may write, is
    refused, and it names folders only (giving back removes the bit it granted, nothing else)."""
    with open(os.open(f"{GRANTS}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)) as lock:
        _check_ours(os.fstat(lock.fileno()), f"{GRANTS}.lock")
        fcntl.flock(lock, fcntl.LOCK_EX)
        record: dict = {}
        try:
            descriptor = os.open(GRANTS, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            pass
        else:
            with open(descriptor) as stored:
                _check_ours(os.fstat(descriptor), str(GRANTS))
                try:
                    record = json.loads(stored.read())
                except ValueError:
                    record = {}
        # A session that died without its teardown holds nothing any more.
        record["holders"] = [pid for pid in record.get("holders", []) if isinstance(pid, int) and Path(f"/proc/{pid}").exists()]
        record["granted"] = [folder for folder in record.get("granted", []) if isinstance(folder, str)]
        yield record
        with open(os.open(GRANTS, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as stored:
            stored.write(json.dumps(record))


def _check_ours(status: os.stat_result, path: str) -> None:
    if status.st_uid != os.geteuid() or status.st_mode & 0o022:
        raise RuntimeError(f"{path} belongs to another user or others may write it: remove it (the tests keep their grants there)")


@pytest.fixture(scope="session")
def others_can_run_oomguard() -> Iterator[None]:
    """Other users must be able to start this Python and read this checkout to run jobs as
    themselves. A test machine's interpreter often sits under a private home (/root is 0700):
    grant search (x, not read) on the folders in the way while any test session needs it
    (xdist workers share the grant), and take it back after the last."""
    targets = [Path(sys.executable).resolve(), Path(sys.prefix).resolve(), Path(__file__).resolve().parent.parent]
    with _grants() as record:
        for target in targets:
            for folder in [target, *target.parents] if target.is_dir() else list(target.parents):
                mode = stat.S_IMODE(folder.stat().st_mode)
                if not mode & stat.S_IXOTH and str(folder) not in record["granted"]:
                    record["granted"].append(str(folder))
                    folder.chmod(mode | stat.S_IXOTH)
        record["holders"].append(os.getpid())
    try:
        yield
    finally:
        with _grants() as record:
            record["holders"] = [pid for pid in record["holders"] if pid != os.getpid()]
            if not record["holders"]:
                for folder in map(Path, reversed(record["granted"])):
                    if folder.is_dir():
                        folder.chmod(stat.S_IMODE(folder.stat().st_mode) & ~stat.S_IXOTH)
                record["granted"] = []


@contextmanager
def spooled_supervisor(folder: Path) -> Iterator[tuple[StateDir, Store, Spool, Supervisor]]:
    """A supervisor with a spool in ``folder`` that takes files and answers requests but starts
    no attempt (its tick runs the spool only)."""
    state = StateDir(folder / "state").create()
    store = Store(state.database)
    spool = Spool(state.inbox, state.accepted, state.rejected, rescan_seconds=0.0)
    supervisor = Supervisor(state, store, spool=spool)
    supervisor.stopping = True
    try:
        yield state, store, spool, supervisor
    finally:
        store.close()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Other test processes may share the cores: more threads than cores makes torch's CPU
    kernels crawl, and one thread keeps the step times comparable. For a module's tests, by
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
