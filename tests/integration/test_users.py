"""Users and trust: who owns a job, who may change it, how its processes are started.

The tests marked `as_root` create throwaway local users (ogtest-alice, -bob, -carol) and groups
(ogtest-extra, ogtest-admin) with useradd/groupadd and remove them at the end of the session;
they are skipped unless the tests run as root on a machine with useradd.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest

from oomguard.daemon import users
from oomguard.daemon.as_user import child_environment, make_user_directory, spawn_options
from oomguard.daemon.users import Account, check_may_change, file_owner, read_owned_file, secure_state_dir, system_mode
from oomguard.strategies.errors import InsecureStateDir, PermissionRefused, UnknownUser

from tests.conftest import ADMIN, ALICE, BOB, EXTRA, as_root, group_exists


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---------------------------------------------------------------------------------- accounts


@as_root
def test_account_from_uid_has_the_kernels_view_of_the_user(accounts: dict[str, Account]) -> None:
    alice = accounts["alice"]
    entry = pwd.getpwnam(ALICE)
    assert Account.from_uid(entry.pw_uid) == alice
    assert (alice.name, alice.uid, alice.gid, alice.home) == (ALICE, entry.pw_uid, entry.pw_gid, f"/nonexistent/{ALICE}")
    assert grp.getgrnam(EXTRA).gr_gid in alice.groups
    assert alice.gid in alice.groups
    assert grp.getgrnam(ADMIN).gr_gid not in alice.groups


def test_account_current_is_the_effective_user() -> None:
    me = Account.current()
    assert me.uid == os.geteuid() and me.name == pwd.getpwuid(os.geteuid()).pw_name


def test_a_uid_without_an_account_is_refused_clearly() -> None:
    uid = next(u for u in range(3_999_000, 4_000_000) if not _uid_exists(u))
    with pytest.raises(UnknownUser, match=f"uid {uid} has no account on this machine") as caught:
        Account.from_uid(uid)
    assert isinstance(caught.value, PermissionRefused) and isinstance(caught.value, LookupError)


def _uid_exists(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def test_system_mode_means_running_as_root() -> None:
    assert system_mode() == (os.geteuid() == 0)


# ---------------------------------------------------------------------------------- file owners


@as_root
def test_a_files_owner_is_who_owns_it(accounts: dict[str, Account], tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text("name = 'x'\n")
    os.chown(job, accounts["alice"].uid, accounts["alice"].gid)
    assert file_owner(job) == accounts["alice"]
    owner, content = read_owned_file(job)
    assert owner == accounts["alice"] and content == b"name = 'x'\n"
    uid = next(u for u in range(3_999_000, 4_000_000) if not _uid_exists(u))
    os.chown(job, uid, uid)
    with pytest.raises(UnknownUser, match=f"job.toml belongs to uid {uid}, which has no account on this machine"):
        file_owner(job)


@as_root
def test_a_symlink_in_the_spool_is_refused_not_followed(accounts: dict[str, Account], tmp_path: Path) -> None:
    target = tmp_path / "bobs.toml"
    target.write_text("")
    os.chown(target, accounts["bob"].uid, accounts["bob"].gid)
    link = tmp_path / "inbox.toml"
    link.symlink_to(target)
    os.chown(link, accounts["alice"].uid, accounts["alice"].gid, follow_symlinks=False)
    for read in (file_owner, read_owned_file):
        with pytest.raises(PermissionRefused, match=r"inbox\.toml is a symbolic link.*copy the job file"):
            read(link)


@as_root
def test_a_hard_linked_file_is_refused(accounts: dict[str, Account], tmp_path: Path) -> None:
    bobs = tmp_path / "bobs.toml"
    bobs.write_text("")
    os.chown(bobs, accounts["bob"].uid, accounts["bob"].gid)
    os.link(bobs, tmp_path / "dropped.toml")
    for read in (file_owner, read_owned_file):
        with pytest.raises(PermissionRefused, match=r"dropped\.toml has 2 hard links"):
            read(tmp_path / "dropped.toml")


def test_read_owned_file_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.toml")  # opening it must not block
    with pytest.raises(PermissionRefused, match="not a regular file"):
        read_owned_file(tmp_path / "fifo.toml")
    (tmp_path / "big.toml").write_bytes(b"x" * 100)
    with pytest.raises(PermissionRefused, match="is 100 bytes; a job file may have at most 10"):
        read_owned_file(tmp_path / "big.toml", limit=10)


# ---------------------------------------------------------------------------------- who may change a job


@as_root
@pytest.mark.parametrize(
    ("requester", "admin_group", "allowed"),
    [("bob", ADMIN, True), ("root", ADMIN, True), ("carol", ADMIN, True), ("alice", ADMIN, False), ("carol", None, False)],
    ids=["owner", "root", "admin-member", "stranger", "no-admin-group"],
)
def test_who_may_change_a_job(accounts: dict[str, Account], requester: str, admin_group: str | None, allowed: bool) -> None:
    who = Account.from_uid(0) if requester == "root" else accounts[requester]
    if allowed:
        check_may_change(who, accounts["bob"].uid, "cancel", "job 3 (sd-lora)", admin_group)
        assert users.is_admin(who, admin_group) == (requester != "bob")
    else:
        with pytest.raises(PermissionRefused) as caught:
            check_may_change(who, accounts["bob"].uid, "cancel", "job 3 (sd-lora)", admin_group)
        tail = f"members of group '{ADMIN}' may" if admin_group else "only its owner or root may"
        assert str(caught.value).startswith(f"{who.name} may not cancel job 3 (sd-lora): it belongs to {BOB}; ")
        assert str(caught.value).endswith(tail)


@as_root
def test_the_stranger_message_in_full(accounts: dict[str, Account]) -> None:
    with pytest.raises(PermissionRefused) as caught:
        check_may_change(accounts["alice"], accounts["bob"].uid, "cancel", "job 3 (sd-lora)", ADMIN)
    assert str(caught.value) == (
        f"{ALICE} may not cancel job 3 (sd-lora): it belongs to {BOB}; only its owner, root or members of group '{ADMIN}' may"
    )


def test_an_admin_group_counts_as_primary_or_supplementary_group() -> None:
    group = grp.getgrgid(0).gr_name  # exists everywhere
    primary = Account("p", 70001, 0, (0,), "/")
    supplementary = Account("s", 70002, 70002, (70002, 0), "/")
    stranger = Account("x", 70003, 70003, (70003,), "/")
    check_may_change(primary, 70009, "resume", "job 1 (a)", group)
    check_may_change(supplementary, 70009, "resume", "job 1 (a)", group)
    with pytest.raises(PermissionRefused, match=f"x may not resume job 1 \\(a\\): it belongs to .*members of group '{group}' may$"):
        check_may_change(stranger, 70009, "resume", "job 1 (a)", group)


def test_a_missing_admin_group_means_no_admins_and_says_so() -> None:
    missing = "ogtest-no-such-group"
    assert not group_exists(missing)
    with pytest.raises(PermissionRefused) as caught:
        check_may_change(Account("x", 70003, 70003, (70003,), "/"), 70009, "cancel", "job 2 (b)", missing)
    message = str(caught.value)
    assert message.startswith("x may not cancel job 2 (b): it belongs to ")
    assert "only its owner or root may" in message
    assert f"the admin group '{missing}' does not exist on this machine" in message and "groupadd" in message


# ---------------------------------------------------------------------------------- starting processes


@as_root
def test_spawn_options_give_the_child_exactly_the_users_credentials(accounts: dict[str, Account]) -> None:
    alice = accounts["alice"]
    options = spawn_options(alice)
    assert options == {"user": alice.uid, "group": alice.gid, "extra_groups": list(alice.groups)}

    def run(*argv: str) -> str:
        return subprocess.run(argv, **options, capture_output=True, text=True, check=True, timeout=30).stdout.strip()

    assert int(run("id", "-u")) == alice.uid
    assert int(run("id", "-g")) == alice.gid
    groups = {int(g) for g in run("id", "-G").split()}
    assert groups == set(alice.groups)  # her extra group, and none of root's
    assert grp.getgrnam(EXTRA).gr_gid in groups and 0 not in groups


def test_spawn_options_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    me = Account("me", 70001, 70001, (70001,), "/home/me")
    monkeypatch.setattr(users.os, "geteuid", lambda: 70001)
    assert spawn_options(me) == {}
    with pytest.raises(PermissionRefused, match="cannot run a process as bob: .* not root"):
        spawn_options(Account("bob", 70002, 70002, (70002,), "/home/bob"))


def test_child_environment_is_the_users_not_the_daemons() -> None:
    daemon_home = pwd.getpwuid(os.geteuid()).pw_dir
    base = {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC",
        "OOMGUARD_STATE_DIR": "/var/lib/oomguard", "CUDA_VISIBLE_DEVICES": "1", "HF_HOME": "/srv/hf",
        "HOME": daemon_home, "USER": "root", "LOGNAME": "root",
        "SUDO_USER": "admin", "SUDO_UID": "1000", "SUDO_COMMAND": "/bin/oomguard", "SSH_AUTH_SOCK": "/tmp/ssh-x/agent",
        "NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000", "XDG_RUNTIME_DIR": "/run/user/0",
        "MAIL": "/var/mail/root", "PWD": "/", "HF_TOKEN": "hf_secret", "AWS_SECRET_ACCESS_KEY": "k",
        "PIP_CACHE_DIR": f"{daemon_home}/.cache/pip",
    }
    bob = Account("bob", 70002, 70002, (70002,), "/home/bob")
    env = child_environment(bob, base)
    assert env == {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC",
        "OOMGUARD_STATE_DIR": "/var/lib/oomguard", "CUDA_VISIBLE_DEVICES": "1", "HF_HOME": "/srv/hf",
        "HOME": "/home/bob", "USER": "bob", "LOGNAME": "bob",
    }
    assert base["SUDO_USER"] == "admin"  # the base is not changed

    # Running a job as ourselves: our credentials and home paths are ours to keep.
    me = Account.current()
    mine = child_environment(me, base)
    assert mine["HF_TOKEN"] == "hf_secret" and mine["PIP_CACHE_DIR"] == base["PIP_CACHE_DIR"]
    assert "SUDO_USER" not in mine and "NOTIFY_SOCKET" not in mine and mine["USER"] == me.name


# ---------------------------------------------------------------------------------- work directories


@as_root
def test_make_user_directory_creates_it_as_the_user(accounts: dict[str, Account], open_tmp: Path) -> None:
    alice = accounts["alice"]
    theirs = open_tmp / "alice"
    theirs.mkdir()
    os.chown(theirs, alice.uid, alice.gid)
    workdir = theirs / "jobs" / "7"
    make_user_directory(workdir, alice)
    for folder in (theirs / "jobs", workdir):
        st = os.lstat(folder)
        assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid) == (alice.uid, alice.gid)
    assert _mode(workdir) == 0o750
    make_user_directory(workdir, alice)  # already there and hers: fine


@as_root
def test_make_user_directory_uses_the_users_rights_not_roots(accounts: dict[str, Account], open_tmp: Path) -> None:
    closed = open_tmp / "closed"
    closed.mkdir(mode=0o755)  # root's, 0755: root could write here, alice cannot
    with pytest.raises(PermissionRefused) as caught:
        make_user_directory(closed / "work", accounts["alice"])
    message = str(caught.value)
    assert f"{ALICE} cannot create {closed / 'work'}" in message and "Permission denied" in message
    assert message.endswith(f"create it and chown it to {ALICE}, or choose a workdir {ALICE} can write")
    assert not (closed / "work").exists()


@as_root
def test_make_user_directory_refuses_a_symlink_and_someone_elses_directory(accounts: dict[str, Account], open_tmp: Path) -> None:
    alice, bob = accounts["alice"], accounts["bob"]
    shared = open_tmp / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    real = shared / "real"
    real.mkdir()
    os.chown(real, alice.uid, alice.gid)
    (shared / "link").symlink_to(real)
    with pytest.raises(PermissionRefused, match=r"link is a symbolic link, not a directory.*chown it to ogtest-alice"):
        make_user_directory(shared / "link", alice)
    bobs = shared / "bobs"
    bobs.mkdir()
    os.chown(bobs, bob.uid, bob.gid)
    with pytest.raises(PermissionRefused, match=f"bobs belongs to {BOB}, not {ALICE}; create it and chown it to {ALICE}"):
        make_user_directory(bobs, alice)


def test_make_user_directory_for_ourselves(tmp_path: Path) -> None:
    me = Account.current()
    make_user_directory(tmp_path / "a" / "b", me)
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(PermissionRefused, match=f"cannot create {tmp_path / 'file'}"):
        make_user_directory(tmp_path / "file", me)



def test_make_user_directory_for_someone_else_needs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(users.os, "geteuid", lambda: 70001)
    with pytest.raises(PermissionRefused, match="cannot run a process as bob: .* not root"):
        make_user_directory(tmp_path / "w", Account("bob", 70002, 70002, (70002,), "/home/bob"))
    assert not (tmp_path / "w").exists()

# ---------------------------------------------------------------------------------- the state directory


def _state_dir(root: Path) -> tuple[Path, Path, list[Path], list[Path]]:
    inbox, accepted, rejected, secrets = root / "spool" / "inbox", root / "spool" / "accepted", root / "spool" / "rejected", root / "secrets"
    for folder in (inbox, accepted, rejected, secrets):
        folder.mkdir(parents=True, mode=0o777)
        folder.chmod(0o777)
    db = root / "oomguard.db"
    db.write_text("")
    db.chmod(0o600)
    return inbox, db, [accepted, rejected, secrets], [db, root / "oomguard.db-wal", root / "oomguard.db-shm"]


@as_root
def test_secure_state_dir_in_system_mode(accounts: dict[str, Account], tmp_path: Path) -> None:
    root = tmp_path / "state"
    root.mkdir(mode=0o700)
    inbox, db, private, public = _state_dir(root)
    secure_state_dir(root, inbox, private, public)
    assert _mode(root) == 0o755
    assert _mode(inbox) == 0o1733
    assert [_mode(p) for p in private] == [0o700] * 3
    assert _mode(db) == 0o644 and not (root / "oomguard.db-wal").exists()  # missing files are left missing

    os.chown(private[2], accounts["alice"].uid, accounts["alice"].gid)
    with pytest.raises(InsecureStateDir, match=f"secrets belongs to {ALICE}, who could change the daemon's state; chown it to root"):
        secure_state_dir(root, inbox, private, public)


@as_root
def test_secure_state_dir_refuses_a_symlink(tmp_path: Path) -> None:
    root = tmp_path / "state"
    root.mkdir()
    inbox, _db, private, public = _state_dir(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    inbox.rmdir()
    inbox.symlink_to(elsewhere)
    with pytest.raises(InsecureStateDir, match="inbox is a symbolic link"):
        secure_state_dir(root, inbox, private, public)
    assert _mode(elsewhere) == 0o755


def test_secure_state_dir_for_a_users_own_daemon_only_closes_the_private_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(users.os, "geteuid", lambda: 70001)
    root = tmp_path / "state"
    root.mkdir()
    root.chmod(0o750)
    inbox, db, private, public = _state_dir(root)
    secure_state_dir(root, inbox, private, public)
    assert _mode(root) == 0o750 and _mode(inbox) == 0o777 and _mode(db) == 0o600
    assert [_mode(p) for p in private] == [0o700] * 3
