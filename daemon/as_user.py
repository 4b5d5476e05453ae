"""Acting as a job's owner: the credentials and environment their processes get
(:func:`spawn_options`, :func:`child_environment`), and their folders, created and resolved as
them (:func:`make_user_directory`). Why each is done this way is the trust model in
daemon/users.py, which says who the owner is and what they may do.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from oomguard.daemon.users import Account, user_name
from oomguard.jobs.attempt import open_folder
from oomguard.strategies.errors import PermissionRefused, UnsafeFolder


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
