"""Who a job belongs to, what they may do, and how their processes are started.

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
(:func:`spawn_options`). Passing only ``user=`` to ``subprocess.Popen`` is a trap: the child
keeps root's gid and root's supplementary groups. Their environment gets their HOME, USER and
LOGNAME and loses what belongs to the daemon's login or service (``SUDO_*``, ``NOTIFY_SOCKET``,
root's credentials; :func:`child_environment`).

*Work directories are created as the user* (:func:`make_user_directory`), so the kernel decides
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

import errno
import grp
import os
import pwd
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.jobs.attempt import UnsafeFolder, open_folder


class PermissionRefused(Exception):
    """A user asked for something they may not do; str() names who, what and why."""


class UnknownUser(PermissionRefused, LookupError):
    """A uid (or name) has no passwd entry on this machine, so nothing may run as it."""


class InsecureStateDir(Exception):
    """The state directory could be changed by someone other than the daemon; str() says how to fix it."""


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


def spawn_options(account: Account) -> dict[str, Any]:
    """Keyword arguments for subprocess.Popen that run the child as `account`.

    As root: uid, gid and the supplementary groups, always all three (``user=`` alone would
    leave the child root's gid and groups). Not as root: {} for our own account, and a refusal
    for anyone else's (switching users takes root).
    Note that Popen changes directory (``cwd=``) *before* it drops privileges: ``cwd`` is entered
    with root's rights, through any link on its path. Never pass a folder of the user's: start the
    child in / and let it enter the folder itself, as the user (daemon/shim.py --workdir, --cwd)."""
    if os.geteuid() == 0:
        return {"user": account.uid, "group": account.gid, "extra_groups": list(account.groups)}
    if account.uid == os.geteuid():
        return {}
    raise PermissionRefused(
        f"cannot run a process as {account.name}: this daemon runs as {user_name(os.geteuid())}, not root, "
        f"and only root can start processes as other users; run the daemon as root (system mode) or "
        f"submit the job as {user_name(os.geteuid())}"
    )


# What belongs to the daemon's login or service, never to a job: sudo's record of who called it,
# ssh/X/D-Bus/Kerberos/GnuPG session handles, systemd's per-service variables (NOTIFY_SOCKET in
# a child could talk to systemd as the daemon), and the daemon's working directory.
_SESSION_VARIABLES = frozenset({
    "MAIL", "XAUTHORITY", "DISPLAY", "DBUS_SESSION_BUS_ADDRESS", "KRB5CCNAME", "GNUPGHOME", "GPG_AGENT_INFO",
    "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME",
    "NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES",
    "INVOCATION_ID", "JOURNAL_STREAM", "MANAGERPID", "SYSTEMD_EXEC_PID", "CREDENTIALS_DIRECTORY",
    "RUNTIME_DIRECTORY", "STATE_DIRECTORY", "CACHE_DIRECTORY", "LOGS_DIRECTORY", "CONFIGURATION_DIRECTORY",
    "PWD", "OLDPWD", "HISTFILE",
})
_SESSION_PREFIXES = ("SUDO_", "SSH_", "XDG_SESSION_")
# The daemon's own credentials (HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...) are not handed to other users.
_CREDENTIAL_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|ACCESS_KEY", re.IGNORECASE)


def child_environment(account: Account, base: Mapping[str, str]) -> dict[str, str]:
    """`base` for a process of `account`: HOME, USER and LOGNAME set for the account; the
    daemon's session variables (SUDO_*, SSH_*, XDG_RUNTIME_DIR, systemd's NOTIFY_SOCKET, ...)
    dropped; and when `account` is not the user this process runs as, also the variables that name
    credentials (…TOKEN, …SECRET…, …PASSWORD…) or point into the daemon's home directory.
    Everything else stays: PATH, LANG/LC_*, TZ, OOMGUARD_*, CUDA_*, HF_HOME elsewhere, ..."""
    other_user = account.uid != os.geteuid()
    old_home = base.get("HOME", "")
    env: dict[str, str] = {}
    for name, value in base.items():
        if name in _SESSION_VARIABLES or name.startswith(_SESSION_PREFIXES):
            continue
        if other_user:
            if _CREDENTIAL_NAME.search(name):
                continue
            if name != "PATH" and old_home not in ("", "/", account.home) and (
                value == old_home or value.startswith(old_home.rstrip("/") + "/")
            ):
                continue
        env[name] = value
    env.update(HOME=account.home, USER=account.name, LOGNAME=account.name)
    return env


def _coreutil(name: str) -> str:
    return shutil.which(name, path="/usr/bin:/bin") or name


# A look at a user's path, as that user, runs in the daemon's loop: it may take this long. A
# user whose look took longer (a hung network mount, or a FUSE file system of their own that
# never answers) is not looked for again for USER_PATH_PAUSE_SECONDS: their job files fail at
# once, saying why, and the loop goes on (systemd's watchdog keeps hearing from the daemon, and
# other users' files are taken).
USER_PATH_SECONDS = 5.0
USER_PATH_PAUSE_SECONDS = 60.0
_slow_since: dict[int, float] = {}


# Runs a short program as a user: (account, argv, timeout) -> its completed process. The
# daemon passes its Launcher's run_as, the only place that starts processes.
RunAs = Callable[[Account, list[str], float], "subprocess.CompletedProcess[str]"]


def _local_run_as() -> RunAs:
    # Imported here: the launcher imports this module (spawn_options).
    from oomguard.daemon.launch.local import LocalLauncher

    return LocalLauncher().run_as


def _run_as(account: Account, argv: list[str], run_as: RunAs | None = None) -> tuple[str | None, str]:
    """Run coreutils' ``argv`` as `account`: (None, its output) on success, else (why not, "").
    A separate process, so that the kernel checks the user's rights (a fork of this
    multi-threaded daemon that ran Python would risk locks held by other threads). coreutils
    rather than sys.executable: the user may not be able to reach the daemon's interpreter (a
    venv under /root), but can always run /bin/mkdir. It starts in /, never in a folder of the
    user's (Popen enters cwd= before it drops root's rights), and has USER_PATH_SECONDS."""
    slow = _slow_since.get(account.uid)
    if slow is not None and time.monotonic() - slow < USER_PATH_PAUSE_SECONDS:
        return (
            f"a look at a path of {account.name}'s took longer than {USER_PATH_SECONDS:.0f} s less than "
            f"{USER_PATH_PAUSE_SECONDS:.0f} s ago (a file system that does not answer?), so the daemon does not wait on "
            f"their paths for now; submit the job again in a minute, with a workdir on a file system that answers"
        ), ""
    try:
        result = (run_as or _local_run_as())(account, argv, USER_PATH_SECONDS)
    except subprocess.TimeoutExpired:
        _slow_since[account.uid] = time.monotonic()
        return (
            f"{os.path.basename(argv[0])} did not answer within {USER_PATH_SECONDS:.0f} s (a file system that does not "
            "answer?); choose a workdir on one that does"
        ), ""
    except (OSError, subprocess.SubprocessError) as error:
        return str(error), ""
    if result.returncode != 0:
        program = argv[0]
        why = result.stderr.strip().removeprefix(f"{program}: ").removeprefix(f"{os.path.basename(program)}: ")
        return why or f"{os.path.basename(program)} exited {result.returncode}", ""
    return None, result.stdout


def _create_as(path: Path, account: Account, run_as: RunAs | None) -> str | None:
    """Create `path` and its missing parents as `account`; None on success, else why not."""
    if os.geteuid() == 0 and account.uid != 0:
        return _run_as(account, [_coreutil("mkdir"), "-p", "-m", "0750", "--", str(path)], run_as)[0]
    spawn_options(account)  # refuses a different user when we are not root
    try:
        os.makedirs(path, mode=0o750, exist_ok=True)
    except OSError as error:
        return f"{error.strerror or error} ({error.filename or path})"
    return None


def _real_path_as(path: Path, account: Account, run_as: RunAs | None) -> tuple[str | None, Path]:
    """(None, the real path of the folder `path` as `account` resolves it), or (why not, path)."""
    if os.geteuid() == 0 and account.uid != 0:
        why, out = _run_as(account, [_coreutil("realpath"), "-e", "--", str(path)], run_as)
        real = out.rstrip("\n")
        return (why, path) if why is not None or not real.startswith("/") else (None, Path(real))
    try:
        return None, Path(os.path.realpath(path, strict=True))
    except OSError as error:
        return f"{error.strerror or error} ({error.filename or path})", path


def make_user_directory(path: Path, account: Account, run_as: RunAs | None = None) -> Path:
    """Create `path` (and missing parents) as `account`, then check that it is a directory, not a
    symbolic link, owned by `account`. An existing directory is accepted if it is theirs.

    Returns the folder's real path: the folders above it resolved *as the user* (their own links
    on the way, such as ~/scratch -> /data/alice, are theirs to use). That is the path the daemon
    keeps, and opens later without following any link a user could have made (jobs/attempt.py
    open_folder): a folder on the way that is swapped for a link after this check is then not
    followed, as root, into someone else's folders. ``run_as``: how to run a program as the
    user (the daemon's Launcher's; by default this machine's)."""
    path = Path(path)
    fix = f"create it and chown it to {account.name}, or choose a workdir {account.name} can write"
    why = _create_as(path, account, run_as)
    if why is not None:
        raise PermissionRefused(f"{account.name} cannot create {path}: {why}; {fix}")
    if path.name in ("", ".."):
        why, real = _real_path_as(path, account, run_as)
    else:
        why, parent = _real_path_as(path.parent, account, run_as)
        real = parent / path.name
    if why is not None:
        raise PermissionRefused(f"{account.name} cannot look at {path}: {why}; {fix}")
    try:
        descriptor = open_folder(real)
    except UnsafeFolder as error:
        if error.filename == str(real) and error.errno == errno.ELOOP:
            raise PermissionRefused(
                f"{path} is a symbolic link, not a directory; a workdir must be a real directory owned by "
                f"{account.name}: remove the link and {fix}"
            ) from None
        if error.filename == str(real) and error.errno == errno.ENOTDIR:
            raise PermissionRefused(f"{path} exists and is not a directory; remove it, or {fix}") from None
        raise PermissionRefused(
            f"{error.filename}, on the way to {path}, is {error.strerror}; the daemon follows no link its users can change: "
            f"give the workdir's real path, or {fix}"
        ) from None
    except OSError as error:
        raise PermissionRefused(f"{path} is not there after creating it as {account.name} ({error.strerror}); {fix}") from None
    try:
        st = os.fstat(descriptor)
    finally:
        os.close(descriptor)
    if st.st_uid != account.uid:  # a directory: open_folder opens nothing else
        raise PermissionRefused(f"{path} belongs to {user_name(st.st_uid)}, not {account.name}; {fix}")
    return real


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
