"""Who a job belongs to and what they may do, and the state directory's modes; how their
processes are started and their folders made is daemon/as_user.py.

The trust model (system mode: the daemon runs as root on a shared box)
-----------------------------------------------------------------------

*Identity comes from the kernel, never from what a user writes.* A job belongs to the owner of
the file that was dropped into the spool inbox, read with ``lstat`` (or ``fstat`` on the file
we then read: :func:`read_owned_file`), never from a field in the job file. The inbox is mode
``1733`` and owned by root: anyone may create a file in it, nobody but root may list it or read
other people's files, and the sticky bit stops anyone from renaming or deleting a file they do
not own. Only root can ``chown`` a file to someone else, so a file owned by bob was created by
bob (or root). What could still lend a user someone else's identity is refused outright: a
symbolic link (it names a file elsewhere; its target's owner is not the submitter) and, for
regular files, a second hard link (a user may be able to link a file of someone else's into the
inbox; ``fs.protected_hardlinks`` usually stops that, we do not rely on it).

*Jobs never reach a shell.* Commands are argv lists handed to ``exec`` directly; placeholders
are substituted as whole arguments, so nothing in a job file is ever parsed by ``/bin/sh``.

*Processes get exactly the owner's credentials:* uid, primary gid and the supplementary groups
of the passwd/group databases (``os.getgrouplist``), all three, every time
(as_user.py :func:`spawn_options`). Passing only ``user=`` to ``subprocess.Popen`` is a trap: the child
keeps root's gid and root's supplementary groups. Their environment gets their HOME, USER and
LOGNAME and loses what belongs to the daemon's login or service (``SUDO_*``, ``NOTIFY_SOCKET``,
root's credentials; as_user.py :func:`child_environment`).

*Work directories are created as the user* (as_user.py :func:`make_user_directory`), so the kernel decides
whether that user may create a directory there; root's own right to write anywhere never
stands in for the user's. The result must be a real directory owned by the user, and its path is
kept as the user resolved it. Every folder of a job is *entered* only by its own processes, as
the user (the shim starts in / and enters the workdir and [command] cwd itself): once a folder
is theirs they can replace what is inside, or the folder itself, with symbolic links, and root
must not follow them. What the daemon must *read* there (an attempt's exit.json, outcome.json,
heartbeat, log) it reads through a descriptor of the folder opened without following a link a
user could have made and checked to be the owner's (jobs/attempt.py AttemptFiles).

*Who may change a job:* its owner, root, and members of the configured admin group
(:func:`check_may_change`). The requester's identity must come from the kernel too (the peer
credentials of a socket, or the owner of a file they dropped), never from a name they type.

*The state directory* (:func:`secure_state_dir`) is root's: 0755 at the top, the inbox 1733,
accepted/, rejected/ and secrets 0700, the database world-readable (it holds no secrets in
clear), and nothing in it may be a symbolic link or belong to another user.

Outside system mode (a user runs the daemon for themselves) nothing changes user: jobs run as
that user, and asking to run anything as someone else is refused.
"""

from __future__ import annotations
from oomguard.strategies.errors import InsecureStateDir, PermissionRefused, UnknownUser

import grp
import os
import pwd
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Account:
    """A local user as the kernel knows it: the credentials their processes get."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups, from os.getgrouplist (includes gid)
    home: str

    @classmethod
    def from_passwd(cls, entry: pwd.struct_passwd) -> Account:
        groups = tuple(dict.fromkeys(os.getgrouplist(entry.pw_name, entry.pw_gid)))
        return cls(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, groups=groups, home=entry.pw_dir)

    @classmethod
    def from_uid(cls, uid: int) -> Account:
        try:
            entry = pwd.getpwuid(uid)
        except KeyError:
            raise UnknownUser(
                f"uid {uid} has no account on this machine (no passwd entry), so nothing can run as it; "
                f"add the user (useradd) or submit as a user that exists"
            ) from None
        return cls.from_passwd(entry)

    @classmethod
    def from_name(cls, name: str) -> Account:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise UnknownUser(f"there is no user named {name!r} on this machine (no passwd entry)") from None
        return cls.from_passwd(entry)

    @classmethod
    def current(cls) -> Account:
        """The account this process acts as (its effective uid)."""
        return cls.from_uid(os.geteuid())

    def __str__(self) -> str:
        return self.name


def system_mode() -> bool:
    """The daemon runs as root (euid 0): jobs run as their owners."""
    return os.geteuid() == 0


def user_name(uid: int) -> str:
    """The name of the user ``uid``, or "uid N" when it has no account."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _owner_from_stat(path: Path, st: os.stat_result) -> Account:
    if stat.S_ISLNK(st.st_mode):
        raise PermissionRefused(
            f"{path} is a symbolic link; a job's owner is the owner of the file itself, so links are refused: "
            f"copy the job file into place (oomguard submit does) instead of linking it"
        )
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        raise PermissionRefused(
            f"{path} has {st.st_nlink} hard links; a linked file may belong to someone other than the one who "
            f"placed it, so it is refused: copy the job file into place (oomguard submit does) instead of linking it"
        )
    try:
        return Account.from_uid(st.st_uid)
    except UnknownUser:
        raise UnknownUser(
            f"{path} belongs to uid {st.st_uid}, which has no account on this machine (no passwd entry), "
            f"so no job can run as its owner; submit it as a user that exists"
        ) from None


def file_owner(path: Path) -> Account:
    """The owner of `path` itself (lstat: a symbolic link is never followed, it is refused)."""
    path = Path(path)
    return _owner_from_stat(path, os.lstat(path))


def read_owned_file(path: Path, limit: int = 1 << 20) -> tuple[Account, bytes]:
    """Open `path` without following a link and return (its owner, its content), both from the
    same open file, so that the file cannot be swapped between asking who owns it and reading it.
    Anything but a regular file (a FIFO, a device, a directory) is refused, and so is a file
    larger than `limit` bytes."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        if os.path.islink(path):
            _owner_from_stat(path, os.lstat(path))  # raises the symlink message
        raise
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PermissionRefused(f"{path} is not a regular file; only job files (TOML) may be submitted")
        owner = _owner_from_stat(path, st)
        if st.st_size > limit:
            raise PermissionRefused(f"{path} ({owner.name}'s) is {st.st_size} bytes; a job file may have at most {limit}")
        return owner, handle.read(limit + 1)[:limit]


def _admin_gid(admin_group: str | None) -> tuple[int | None, str]:
    """(gid of the admin group or None, the phrase that names who may act)."""
    if not admin_group:
        return None, "only its owner or root may"
    try:
        return grp.getgrnam(admin_group).gr_gid, f"only its owner, root or members of group {admin_group!r} may"
    except KeyError:
        return None, (
            f"only its owner or root may (the admin group {admin_group!r} does not exist on this machine; "
            f"create it with groupadd and add the admins to it to give them these rights)"
        )


def is_admin(account: Account, admin_group: str | None) -> bool:
    """Root, or a member (primary or supplementary) of `admin_group` when that group exists."""
    if account.uid == 0:
        return True
    gid, _ = _admin_gid(admin_group)
    return gid is not None and (gid == account.gid or gid in account.groups)


def check_may_change(requester: Account, owner_uid: int, action: str, job_label: str, admin_group: str | None) -> None:
    """Allow the job's owner, root and members of `admin_group`; refuse anyone else, saying why.

    A missing `admin_group` counts as no admin group, and the refusal says that it is missing."""
    if requester.uid == owner_uid or requester.uid == 0:
        return
    gid, who_may = _admin_gid(admin_group)
    if gid is not None and (gid == requester.gid or gid in requester.groups):
        return
    raise PermissionRefused(f"{requester.name} may not {action} {job_label}: it belongs to {user_name(owner_uid)}; {who_may}")


def _secure(path: Path, mode: int, daemon_uid: int, strict: bool) -> None:
    """chmod `path` to `mode` if it exists. Strict (system mode): through a descriptor opened
    without following links, so that a link is refused and nothing can be swapped in between the
    check and the chmod, and only if it belongs to the daemon."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if strict else 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return
    except OSError:
        if strict and os.path.islink(path):
            raise InsecureStateDir(
                f"{path} is a symbolic link; the daemon's state must be real files and directories: "
                f"replace it with the directory or file it points to"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if strict and st.st_uid != daemon_uid:
            owner = user_name(daemon_uid)
            raise InsecureStateDir(
                f"{path} belongs to {user_name(st.st_uid)}, who could change the daemon's state; "
                f"chown it to {owner} (chown -R {owner}: {path})"
            )
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def secure_state_dir(root: Path, inbox: Path, private_dirs: Iterable[Path], public_files: Iterable[Path]) -> None:
    """Give the state directory its modes.

    System mode: `root` 0755, `inbox` 1733 (anyone may drop a file, nobody may list or read
    other people's, the sticky bit stops anyone deleting or renaming someone else's file),
    `private_dirs` 0700 (accepted/, rejected/, secrets), `public_files` 0644 (the SQLite database
    and its -wal/-shm, where they exist). All of them must be owned by the daemon (root) and none
    may be a symbolic link (InsecureStateDir says which and how to fix it).
    Otherwise (a user's own daemon): only `private_dirs` change, to 0700."""
    uid = os.geteuid()
    if not system_mode():
        for folder in private_dirs:
            _secure(Path(folder), 0o700, uid, strict=False)
        return
    _secure(Path(root), 0o755, uid, strict=True)
    _secure(Path(inbox), 0o1733, uid, strict=True)
    for folder in private_dirs:
        _secure(Path(folder), 0o700, uid, strict=True)
    for file in public_files:
        _secure(Path(file), 0o644, uid, strict=True)
