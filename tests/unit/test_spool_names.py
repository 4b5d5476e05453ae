"""Spool names nobody can take first, answers only for the file that asked, names resolved
among the asker's own jobs first, and the priority cap (issue 23, points 2 and 7).

These run as any user: another user is stood in for by a record in the store with another uid.
tests/e2e/test_security_spool.py runs the same attacks as two real users against a root daemon.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.daemon import inbox as inbox_module
from oomguard.daemon.cli import main
from oomguard.daemon.cli.parser import build_parser
from oomguard.daemon.inbox import NAME_TRIES, request_text, write_to_inbox
from oomguard.daemon.paths import StateDir
from oomguard.daemon.spool import DEFAULT_MAX_USER_PRIORITY, Request, Spool, priority_refusal
from oomguard.daemon.store import Store
from oomguard.daemon.supervisor import Supervisor
from oomguard.daemon.users import Account
from oomguard.strategies.errors import AmbiguousJobName, InboxNameTaken, JobNotFound
from tests.conftest import spooled_supervisor
from tests.jobs_helpers import TINY_JOB

OTHER_UID = 64999  # a uid nobody here has: "bob", whose records the tests make up
ME = Account.current()


def job_text(name: str, priority: int | None = None) -> str:
    text = TINY_JOB.format(name=name, batch_size=8, max_steps=4, checkpoint_every_steps=2, keep_checkpoints=2)
    return text if priority is None else f"priority = {priority}\n{text}"


@pytest.fixture
def box(tmp_path: Path) -> Iterator[tuple[StateDir, Store, Spool, Supervisor]]:
    with spooled_supervisor(tmp_path) as parts:
        yield parts


def drop(state: StateDir, name: str, text: str) -> Path:
    path = state.inbox / name
    path.write_text(text)
    os.utime(path, (1, 1))  # settled: the rescan takes it at once
    return path


def add_job(store: Store, name: str, *, uid: int, owner: str, spool_file: str | None = None) -> int:
    return store.add_job(
        name=name, owner=owner, owner_uid=uid, spec={"name": name}, priority=0, workdir="/nonexistent/w",
        plan={"batch_size": 8, "micro_batch": 8}, spool_file=spool_file, jobs_root=Path("/jobs"),
    )


def tokens(monkeypatch: pytest.MonkeyPatch, *values: str) -> None:
    """The random parts write_to_inbox draws, in turn (the last one again and again)."""
    queue = list(values)
    monkeypatch.setattr(inbox_module, "unguessable_token", lambda: queue.pop(0) if len(queue) > 1 else queue[0])


# ------------------------------------------------------------------------------ names


def test_inbox_names_are_unguessable_private_and_new_each_time(tmp_path: Path) -> None:
    names = [write_to_inbox(tmp_path, "alice-long", "x").name for _ in range(3)]
    assert len(set(names)) == 3
    for name in names:
        # 128 random bits; nothing of the process id or the clock, which others can guess.
        assert re.fullmatch(r"alice-long-[0-9a-f]{32}\.toml", name), name
        assert str(os.getpid()) not in name
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)  # no temporary file left


def test_a_taken_temporary_name_is_never_followed_or_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim"
    victim.write_text("bob's")
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / f".{'a' * 32}.tmp").symlink_to(victim)
    tokens(monkeypatch, "a" * 32, "b" * 32)
    final = write_to_inbox(inbox, "job", "alice's")
    assert final.name == f"job-{'b' * 32}.toml" and final.read_text() == "alice's"
    assert victim.read_text() == "bob's" and (inbox / f".{'a' * 32}.tmp").is_symlink()


def test_a_taken_final_name_is_never_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"job-{'a' * 32}.toml").write_text("bob's")
    tokens(monkeypatch, "a" * 32, "b" * 32)
    final = write_to_inbox(tmp_path, "job", "alice's")
    assert final.name == f"job-{'b' * 32}.toml" and final.read_text() == "alice's"
    assert (tmp_path / f"job-{'a' * 32}.toml").read_text() == "bob's"
    assert not list(tmp_path.glob(".*"))  # the temporary file of the failed try is gone


def test_names_that_are_always_taken_end_in_an_error_not_a_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"job-{'a' * 32}.toml").write_text("bob's")
    tokens(monkeypatch, "a" * 32)
    with pytest.raises(InboxNameTaken, match=f"{NAME_TRIES} fresh names"):
        write_to_inbox(tmp_path, "job", "alice's")
    assert [p.name for p in tmp_path.iterdir()] == [f"job-{'a' * 32}.toml"]


# ------------------------------------------------------------------------------ the daemon: a used name


def test_a_job_file_under_a_name_recorded_for_another_user_is_refused(box) -> None:
    state, store, _, supervisor = box
    bobs = add_job(store, "bobs", uid=OTHER_UID, owner="bob", spool_file="taken.toml")
    drop(state, "taken.toml", job_text("mine"))
    supervisor.tick()
    assert [job.id for job in store.jobs()] == [bobs]  # nothing recorded for it, bob's record as it was
    assert store.job(bobs).owner_uid == OTHER_UID and not (state.accepted / f"{bobs:06d}-taken.toml").exists()
    error = (state.rejected / "taken.toml.error").read_text()
    assert f"this name was used already, by job {bobs} of bob" in error and "give the file a new name" in error


def test_a_job_file_recorded_before_a_crash_is_still_moved_and_a_reused_name_is_refused(box) -> None:
    state, store, _, supervisor = box
    mine = add_job(store, "mine", uid=ME.uid, owner=ME.name, spool_file="mine.toml")
    drop(state, "mine.toml", job_text("mine"))
    supervisor.tick()  # recorded, then the daemon died before the move: the move is finished
    assert (state.accepted / f"{mine:06d}-mine.toml").read_text() == job_text("mine")
    drop(state, "mine.toml", job_text("second"))
    supervisor.tick()  # the same name again, by hand: refused, not lost in job 1's record
    assert (state.accepted / f"{mine:06d}-mine.toml").read_text() == job_text("mine")
    assert f"used already, by your job {mine} (mine)" in (state.rejected / "mine.toml.error").read_text()
    assert len(store.jobs()) == 1


def test_a_request_under_a_name_answered_for_another_user_is_refused(box) -> None:
    state, store, _, supervisor = box
    mine = add_job(store, "mine", uid=ME.uid, owner=ME.name)
    store.add_request(file="cancel.request", requester="bob", action="cancel", job_key="9", job_id=None, accepted=0, answer="bob's refusal")
    drop(state, "cancel.request", request_text("cancel", str(mine)))
    supervisor.tick()
    assert "used already, by a file of bob" in (state.rejected / "cancel.request.error").read_text()
    assert store.request_by_file("cancel.request").answer == "bob's refusal"
    assert not store.job(mine).cancel_requested
    # The same user's own answered request (the daemon died before removing it) just goes.
    store.add_request(file="again.request", requester=ME.name, action="cancel", job_key="1", job_id=mine, accepted=1, answer="ok")
    drop(state, "again.request", request_text("cancel", str(mine)))
    supervisor.tick()
    assert not (state.inbox / "again.request").exists() and not (state.rejected / "again.request.error").exists()


# ------------------------------------------------------------------------------ the CLI: only its own answer


def test_submit_never_reports_a_job_recorded_for_someone_else(box, tmp_path: Path, monkeypatch, capsys) -> None:
    state, store, _, _ = box
    tokens(monkeypatch, "a" * 32)  # as if bob had foreseen the name
    bobs = add_job(store, "bobs", uid=OTHER_UID, owner="bob", spool_file=f"mine-{'a' * 32}.toml")
    job_file = tmp_path / "mine.toml"
    job_file.write_text(job_text("mine"))
    assert main(["--state-dir", str(state.root), "submit", str(job_file), "--wait", "3"]) == 1
    out, err = capsys.readouterr()
    assert "queued" not in out and f"job {bobs}" in err and "that is not your job, and yours was not queued; submit it again" in err


def test_cancel_never_reports_an_answer_given_to_someone_else(box, monkeypatch, capsys) -> None:
    state, store, _, _ = box
    mine = add_job(store, "mine", uid=ME.uid, owner=ME.name)
    tokens(monkeypatch, "a" * 32)
    store.add_request(
        file=f"cancel-{mine}-{'a' * 32}.request", requester="bob", action="cancel", job_key=str(mine), job_id=mine, accepted=0,
        answer="bob may not cancel it",
    )
    assert main(["--state-dir", str(state.root), "cancel", "mine", "--wait", "3"]) == 1
    out, err = capsys.readouterr()
    assert "bob may not cancel it" not in out + err and "its answer is not yours" in err


# ------------------------------------------------------------------------------ names of jobs


def test_a_name_means_your_own_job_first(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    alice, bob, carol = 61001, 61002, 61003
    alices = add_job(store, "shared", uid=alice, owner="alice")
    bobs = add_job(store, "shared", uid=bob, owner="bob")  # newer, same name
    solo = add_job(store, "solo", uid=bob, owner="bob")
    assert store.job_for("shared", alice).id == alices
    assert store.job_for("shared", bob).id == bobs
    assert store.job_for("solo", alice).id == solo  # nobody else's name clashes: the one job of it
    assert store.job_for(str(bobs), alice).id == bobs  # an id is that job, whoever's
    with pytest.raises(AmbiguousJobName, match=rf"you have no job named 'shared'.*{alices} \(alice, queued\), {bobs} \(bob, queued\).*by its id"):
        store.job_for("shared", carol)
    again = add_job(store, "shared", uid=alice, owner="alice")
    with pytest.raises(AmbiguousJobName, match=rf"several of your jobs are named 'shared': {alices} \(queued\), {again} \(queued\)"):
        store.job_for("shared", alice)
    with pytest.raises(JobNotFound):
        store.job_for("nope", alice)
    # A job recorded before owner_uid was: its owner's name says whose it is.
    store.db["jobs"].update(alices, {"owner_uid": None})
    store.db["jobs"].update(again, {"owner_uid": None})
    with pytest.raises(AmbiguousJobName, match="you have no job named"):
        store.job_for("shared", alice)  # without the owner's name they are not known as alice's
    with pytest.raises(AmbiguousJobName, match="several of your jobs"):
        store.job_for("shared", alice, "alice")
    store.close()


def test_show_of_a_name_several_others_share_is_refused_with_the_ids(box, capsys) -> None:
    state, store, _, _ = box
    first, second = add_job(store, "shared", uid=61001, owner="alice"), add_job(store, "shared", uid=61002, owner="bob")
    for command in ("show", "logs", "report", "cancel"):
        assert main(["--state-dir", str(state.root), command, "shared"]) == 2, command
        err = capsys.readouterr().err
        assert f"{first} (alice, queued), {second} (bob, queued)" in err and "name the one you mean by its id" in err
    mine = add_job(store, "shared", uid=ME.uid, owner=ME.name)
    assert main(["--state-dir", str(state.root), "show", "shared"]) == 0
    assert f"job {mine} shared (owner {ME.name})" in capsys.readouterr().out


def test_a_request_by_name_means_the_requesters_own_job(box) -> None:
    _, store, _, supervisor = box
    nobody = Account.from_name("nobody")
    theirs = add_job(store, "shared", uid=nobody.uid, owner=nobody.name)
    mine = add_job(store, "shared", uid=ME.uid, owner=ME.name)  # newer, same name
    supervisor._answer(Request(requester=nobody, action="cancel", job="shared", spool_file="n.request"))
    assert store.request_by_file("n.request").accepted is True
    assert store.job(theirs).cancel_requested and not store.job(mine).cancel_requested


# ------------------------------------------------------------------------------ the priority cap


def test_the_priority_cap_holds_for_users_and_not_for_root_admins_or_the_daemons_user() -> None:
    user = Account("alice", 61001, 61001, (61001,), "/")
    refusal = priority_refusal(user, 2**63 - 1, 100, None, "alice-long.toml")
    assert refusal is not None and "alice-long.toml: priority 9223372036854775807 is above 100" in refusal
    assert "set `priority` to 100 or less" in refusal and "--max-user-priority" in refusal and "only root may" in refusal
    assert priority_refusal(user, 100, 100, None, "f") is None
    assert priority_refusal(user, -(2**63), 100, None, "f") is None
    assert priority_refusal(user, 10**6, None, None, "f") is None  # no cap
    admin = Account("carol", 61003, 61003, (61003, 0), "/")  # in group root (gid 0), made the admin group
    assert priority_refusal(admin, 10**6, 100, "root", "f") is None
    assert "root and members of group 'root'" in priority_refusal(user, 10**6, 100, "root", "f")
    assert priority_refusal(Account("root", 0, 0, (0,), "/root"), 10**6, 100, None, "f") is None
    assert priority_refusal(ME, 10**6, 100, None, "f") is None  # the daemon's own user


def test_the_daemons_own_user_may_set_any_priority(box) -> None:
    state, store, _, supervisor = box
    drop(state, "high.toml", job_text("high", priority=2**63 - 1))
    supervisor.tick()
    assert store.job("high").priority == 2**63 - 1


def test_the_daemon_option_and_its_default() -> None:
    daemon = next(a for a in build_parser()._subparsers._group_actions[0].choices["daemon"]._actions if a.dest == "max_user_priority")
    assert f"default {DEFAULT_MAX_USER_PRIORITY}" in daemon.help
    assert DEFAULT_MAX_USER_PRIORITY == 100
    assert json.loads(request_text("cancel", "1")) == {"action": "cancel", "job": "1"}


@pytest.mark.parametrize("kernel_call", [True, False], ids=["renameat2", "without-renameat2"])
def test_the_rename_never_replaces_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel_call: bool) -> None:
    if not kernel_call:
        monkeypatch.setattr(inbox_module, "_renameat2", lambda: None)
    (tmp_path / "source").write_text("alice's")
    (tmp_path / "target").write_text("bob's")
    with pytest.raises(FileExistsError):
        inbox_module.rename_no_replace(tmp_path / "source", tmp_path / "target")
    assert (tmp_path / "target").read_text() == "bob's"
    inbox_module.rename_no_replace(tmp_path / "source", tmp_path / "new")
    assert (tmp_path / "new").read_text() == "alice's" and not (tmp_path / "source").exists()
