"""Paths a user controls, as a daemon running as root must treat them (issue 23, points 1, 4, 5):
folders are entered only by the job's own processes (the shim enters the workdir, as the user);
what root reads of an attempt it reads through a descriptor of the folder, opened without
following a link a user could have made and checked to be the owner's; a data folder is looked
through with a bound, and a job file that root parses for another user is not resolved on the
file system as root. The end-to-end attacks are in tests/e2e/test_security_paths.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.daemon.shim import CANNOT_USE_FOLDER, EXIT_STATUS
from oomguard.daemon.as_user import make_user_directory
from oomguard.jobs.spec import unconditional as spec_module
from oomguard.jobs.attempt import AttemptFiles, open_folder
from oomguard.jobs.spec import parse_job_text
from oomguard.strategies.errors import JobFileError, PermissionRefused, UnsafeFolder
from tests.conftest import as_root

# ------------------------------------------------------------------------- opening a user's folder


def test_open_folder_follows_its_own_users_links_but_never_the_last_component(tmp_path: Path) -> None:
    real = tmp_path / "real" / "work"
    real.mkdir(parents=True)
    (tmp_path / "via").symlink_to(tmp_path / "real")  # ours (root's, or this user's): followed
    descriptor = open_folder(tmp_path / "via" / "work")
    try:
        assert os.path.samestat(os.fstat(descriptor), os.stat(real))
    finally:
        os.close(descriptor)
    (tmp_path / "last").symlink_to(real)
    with pytest.raises(UnsafeFolder) as caught:
        open_folder(tmp_path / "last")
    assert caught.value.errno == errno.ELOOP and caught.value.filename == str(tmp_path / "last")
    with pytest.raises(FileNotFoundError):
        open_folder(tmp_path / "missing")
    with pytest.raises(UnsafeFolder, match="belongs to uid"):
        os.close(open_folder(real, owner_uid=os.geteuid() + 1))


@as_root
def test_open_folder_does_not_follow_a_link_a_user_made(accounts, open_tmp: Path) -> None:
    bob = accounts["bob"]
    (open_tmp / "target" / "1").mkdir(parents=True)
    home = open_tmp / "bob"
    home.mkdir()
    os.chown(home, bob.uid, bob.gid)
    (home / "p").symlink_to(open_tmp / "target")
    os.lchown(home / "p", bob.uid, bob.gid)  # bob's own link, as if he had made it
    with pytest.raises(UnsafeFolder) as caught:
        os.close(open_folder(home / "p" / "1"))
    assert caught.value.filename == str(home / "p") and "symbolic link" in caught.value.strerror
    os.lchown(home / "p", 0, 0)  # the same link put there by root: followed
    os.close(open_folder(home / "p" / "1"))


@as_root
def test_attempt_files_are_read_only_from_the_owners_folders_and_files(accounts, open_tmp: Path) -> None:
    alice, bob = accounts["alice"], accounts["bob"]
    attempt = open_tmp / "w" / "attempts" / "001"
    attempt.mkdir(parents=True)
    for folder in (open_tmp / "w", attempt.parent, attempt):
        os.chown(folder, alice.uid, alice.gid)
    (attempt / "exit.json").write_text('{"returncode": 0}')
    os.chown(attempt / "exit.json", alice.uid, alice.gid)
    (attempt / "heartbeat.json").write_text('{"step": 3}')  # root's: not a file her processes wrote
    (open_tmp / "roots").write_text("root's own")
    os.link(open_tmp / "roots", attempt / "output.log")  # a hard link to a file that is not hers
    with AttemptFiles.owned_by(attempt, alice.uid, alice.name) as files:
        assert files.problem is None
        assert files.read_json("exit.json") == {"returncode": 0}
        assert files.read_json("heartbeat.json") is None
        with pytest.raises(OSError):
            files.open("output.log")
        assert files.mtime("exit.json") is not None and files.mtime("missing.json") is None
    # The same folder is not bob's: nothing is read, and why is said without saying what is there.
    with AttemptFiles.owned_by(attempt, bob.uid, bob.name) as files:
        assert files.read_json("exit.json") is None
        assert files.problem is not None and "ogtest-bob's" in files.problem and "read nothing" in files.problem
    missing = AttemptFiles.owned_by(open_tmp / "nowhere" / "attempts" / "001", bob.uid, bob.name)
    assert missing.problem is not None and missing.problem.replace("nowhere", "w") == files.problem


def test_attempt_files_of_a_path_read_as_before(tmp_path: Path) -> None:
    (tmp_path / "exit.json").write_text('{"returncode": 2}')
    (tmp_path / "heartbeat.json").symlink_to(tmp_path / "exit.json")
    files = AttemptFiles(tmp_path)
    assert files.read_json("exit.json") == {"returncode": 2}
    assert files.read_json("heartbeat.json") is None  # a link is never followed
    assert AttemptFiles(tmp_path / "missing").read_json("exit.json") is None


# ------------------------------------------------------------------------- work directories


@as_root
def test_a_workdir_is_kept_under_its_real_path_as_its_owner_resolves_it(accounts, open_tmp: Path) -> None:
    alice = accounts["alice"]
    data = open_tmp / "data" / "alice"
    data.mkdir(parents=True)
    os.chown(data, alice.uid, alice.gid)
    home = open_tmp / "alice"
    home.mkdir()
    os.chown(home, alice.uid, alice.gid)
    (home / "scratch").symlink_to(data)
    os.lchown(home / "scratch", alice.uid, alice.gid)  # her own link: hers to use
    real = make_user_directory(home / "scratch" / "run1", alice)
    assert real == data / "run1" and os.stat(real).st_uid == alice.uid
    os.close(open_folder(real, owner_uid=alice.uid))  # what the daemon opens later


def test_make_user_directory_returns_the_real_path_for_ourselves(tmp_path: Path) -> None:
    from oomguard.daemon.users import Account

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert make_user_directory(tmp_path / "link" / "w", Account.current()) == tmp_path / "real" / "w"
    with pytest.raises(PermissionRefused, match="is a symbolic link, not a directory"):
        make_user_directory(tmp_path / "link", Account.current())


@as_root
def test_a_users_path_that_does_not_answer_holds_the_daemon_once_not_at_every_file(accounts, open_tmp: Path, monkeypatch) -> None:
    from oomguard.daemon import as_user

    monkeypatch.setattr(as_user, "_slow_since", {})
    calls: list[list[str]] = []

    def hangs(argv: list[str], **options: object) -> None:
        calls.append(argv)
        assert options["timeout"] == as_user.USER_PATH_SECONDS and options["cwd"] == "/"
        raise subprocess.TimeoutExpired(argv, as_user.USER_PATH_SECONDS)

    monkeypatch.setattr(as_user.subprocess, "run", hangs)
    alice, bob = accounts["alice"], accounts["bob"]
    with pytest.raises(PermissionRefused, match=r"mkdir did not answer within 5 s \(a file system that does not answer\?\)"):
        make_user_directory(open_tmp / "fuse" / "w1", alice)
    # Her next job files are refused at once: the daemon's loop is not held again for a minute.
    for number in range(5):
        with pytest.raises(PermissionRefused, match="the daemon does not wait on their paths for now; submit the job again in a minute"):
            make_user_directory(open_tmp / "fuse" / f"w{number + 2}", alice)
    assert len(calls) == 1
    with pytest.raises(PermissionRefused, match="did not answer"):
        make_user_directory(open_tmp / "elsewhere", bob)  # another user is looked for as before
    assert len(calls) == 2


# ------------------------------------------------------------------------- the shim enters the workdir


def run_shim(attempt: Path, *options: str, command: str = "import os; print(os.getcwd())") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oomguard.daemon.shim", str(attempt), *options, "--", sys.executable, "-c", command],
        input="", capture_output=True, text=True, timeout=60, cwd="/",
    )


def test_the_shim_enters_the_workdir_itself_and_the_command_runs_there(tmp_path: Path) -> None:
    workdir = tmp_path / "w"
    workdir.mkdir()
    done = run_shim(workdir / "attempts" / "001", "--workdir", str(workdir))
    assert done.returncode == 0, done.stderr
    assert (workdir / "attempts" / "001" / "output.log").read_text() == f"{workdir}\n"
    # [command] cwd, when given, is where the command runs; the workdir is still entered first.
    (tmp_path / "project").mkdir()
    done = run_shim(workdir / "attempts" / "002", "--workdir", str(workdir), "--cwd", str(tmp_path / "project"))
    assert (workdir / "attempts" / "002" / "output.log").read_text() == f"{tmp_path / 'project'}\n"


def test_a_workdir_the_shim_cannot_enter_ends_it_with_its_own_status(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    done = run_shim(gone / "attempts" / "001", "--workdir", str(gone))
    assert done.returncode == CANNOT_USE_FOLDER
    assert done.stderr.startswith(f"oomguard: the attempt cannot enter its workdir {gone} as ") and "No such file or directory" in done.stderr
    assert not (gone / "attempts" / "001" / EXIT_STATUS).exists()


def test_a_full_disk_under_the_workdir_ends_the_shim_with_its_own_status_and_the_attempt_waits_for_room(tmp_path: Path) -> None:
    """In the soak (bench/soak.py) a disk that filled while jobs were queued made the shim's
    mkdir fail: read as 'could not enter its workdir', a crash, it used up the job's retries."""
    from oomguard.daemon.conclude import conclude
    from oomguard.daemon.launch import Exit
    from oomguard.daemon.store import Store
    from oomguard.jobs.attempt import attempt_files
    from oomguard.daemon.shim import NO_ROOM_FOR_FOLDER
    from tests.small_disk import fill, small_disk

    with small_disk(tmp_path / "disk", 1024 * 1024) as disk:
        fill(disk, leave=0)
        workdir = disk / "work"
        workdir.mkdir()
        done = run_shim(workdir / "attempts" / "001", "--workdir", str(workdir))
        assert done.returncode == NO_ROOM_FOR_FOLDER and "No space left on device" in done.stderr
        store = Store(tmp_path / "oomguard.db")
        job_id = store.add_job(name="j", owner="me", spec={}, priority=0, workdir=str(workdir), plan={}, spool_file=None, jobs_root=tmp_path)
        attempt_id = store.add_attempt(job_id=job_id, number=1, plan="{}", directory=str(workdir / "attempts" / "001"), started_at=1.0, pid=1)
        ended = Exit(returncode=None, recorded=True, no_folder=True, no_room=True)
        outcome = conclude(store.job(job_id), store.attempt(attempt_id), attempt_files(workdir / "attempts" / "001"), ended, lambda at: False)
        store.close()
    assert outcome.kind == "disk_full" and outcome.disk_path == str(workdir)


@as_root
def test_the_shim_enters_the_workdir_as_the_user_not_as_root(accounts, open_tmp: Path, others_can_run_oomguard) -> None:
    # A folder only root may enter: the shim, as alice, cannot, though the daemon could.
    private = open_tmp / "private"
    private.mkdir(mode=0o700)
    alice = accounts["alice"]
    done = subprocess.run(
        ["runuser", "-u", alice.name, "--", sys.executable, "-m", "oomguard.daemon.shim", str(private / "attempts" / "001"),
         "--workdir", str(private), "--", sys.executable, "-c", "pass"],
        input="", capture_output=True, text=True, timeout=60, cwd="/",
    )
    assert done.returncode == CANNOT_USE_FOLDER and "Permission denied" in done.stderr
    assert not (private / "attempts").exists()


# ------------------------------------------------------------------------- data folders


def data_job(source: str) -> str:
    return (
        f'name = "d"\ntrainer = "unconditional"\n[data]\nsource = {json.dumps(source)}\nresolution = 16\n'
        '[model]\nblock_out_channels = [8, 16]\nlayers_per_block = 1\ndown_block_types = ["DownBlock2D", "DownBlock2D"]\n'
        'up_block_types = ["UpBlock2D", "UpBlock2D"]\nnorm_num_groups = 4\n[train]\nbatch_size = 4\nmax_steps = 2\nlearning_rate = 1e-3\n'
    )


def test_a_huge_data_folder_is_looked_through_with_a_bound(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(spec_module, "DATA_SCAN_ENTRIES", 50)
    folder = tmp_path / "huge"
    folder.mkdir()
    for number in range(60):
        (folder / f"{number:03d}.txt").write_text("")
    # The bound is reached before any image: nothing is decided, the job is accepted (its
    # runner lists the folder as its owner when it starts).
    assert parse_job_text(data_job(str(folder)), "job.toml").data.source == str(folder)
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "a.txt").write_text("")
    with pytest.raises(JobFileError, match="no image files"):
        parse_job_text(data_job(str(tmp_path / "small")), "job.toml")


def test_looking_through_data_folders_takes_at_most_a_share_of_the_time(tmp_path: Path, monkeypatch) -> None:
    budget = spec_module._ScanBudget()
    monkeypatch.setattr(spec_module, "_SCAN_BUDGET", budget)
    (tmp_path / "empty").mkdir()
    budget.spend(budget.grant() + 10.0)  # a burst of looks has used it up
    # Out of budget, a look decides nothing (the daemon's loop goes on); an empty folder is
    # then accepted, and its runner says it holds no images.
    assert spec_module._has_image(tmp_path / "empty") is None
    budget.left = spec_module._SCAN_BURST_SECONDS
    assert spec_module._has_image(tmp_path / "empty") is False


@as_root
def test_a_data_folder_the_user_may_not_read_says_so_and_how_to_fix_it(accounts, open_tmp: Path, others_can_run_oomguard) -> None:
    closed = open_tmp / "closed"
    closed.mkdir(mode=0o700)  # root's: alice may see it exists (its parent is public), not read it
    script = (
        "import sys; from oomguard.jobs.spec import parse_job_text; from oomguard.strategies.errors import JobFileError\n"
        "try: parse_job_text(sys.stdin.read(), 'job.toml')\n"
        "except JobFileError as e: print(e)\n"
    )
    done = subprocess.run(
        ["runuser", "-u", accounts["alice"].name, "--", sys.executable, "-c", script],
        input=data_job(str(closed)), capture_output=True, text=True, timeout=60, cwd="/",
    )
    assert done.stdout.strip() == (
        f'job.toml: data.source: cannot read folder "{closed}": Permission denied; give a folder you can read, '
        "or ask its owner to let you read it (the job runs as you)"
    )


def test_a_job_file_parsed_without_looking_is_not_resolved_on_the_file_system(tmp_path: Path) -> None:
    # The daemon (root) parses other users' job files without looking at their paths: their
    # links are not followed by root, and where a link in a folder only root may read points is
    # not stored for them to see. Their own processes resolve the paths, as them.
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    text = data_job(str(tmp_path / "link" / "imgs")).replace('name = "d"\n', f'name = "d"\nworkdir = "{tmp_path / "link" / "w"}"\n')
    unlooked = parse_job_text(text, "job.toml", check_files=False)
    assert unlooked.workdir == str(tmp_path / "link" / "w") and unlooked.data is not None
    assert unlooked.data.source == str(tmp_path / "link" / "imgs")
    relative = parse_job_text(text.replace(str(tmp_path / "link" / "w"), "runs/../w"), "job.toml", base_dir=tmp_path / "link", check_files=False)
    assert relative.workdir == str(tmp_path / "link" / "runs" / ".." / "w")
