"""Issue 23, points 2 and 7, as two real users (ogtest-alice, ogtest-bob; ogtest-carol is a third
user and an admin) against a real root daemon in a temporary folder.

Point 2: names in the spool could be taken first. Inbox and request names were time-pid-stem:
bob made the names alice's next submit or cancel would use, the daemon recorded his files under
them, and alice's CLI then reported his job or his refusal as hers. Here alice's CLI runs with a
process id and a clock bob knows (what 1,200 guessed names did in the report), bob makes every
name that could give, and alice must still get her own job and her own answer; bob's replay of
names alice used is refused. Point 7: a job of bob's named like alice's must not shadow hers, a
name that means several jobs is refused with their ids, and users' priorities are capped.

Everything else stays queued behind one job of root's that holds the daemon's only slot, so no
job here trains.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store
from tests.conftest import ADMIN, as_root
from tests.e2e.conftest import Daemon, kill_leftovers, oomguard, wait_for

pytestmark = as_root

# `oomguard ARGS` with a process id and a clock that bob knows in advance: what the names of the
# inbox files could be made of before, and must not be.
FORESEEABLE_PID, FORESEEABLE_TIME = 4242, "20990101-000000"
FORESEEABLE_CLI = (
    "import os, sys, time\n"
    f"os.getpid = lambda: {FORESEEABLE_PID}\n"
    f"time.strftime = lambda *args: {FORESEEABLE_TIME!r}\n"
    "from oomguard.daemon.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
# bob makes files in the inbox himself: names and texts as JSON on standard input.
BOB_MAKES_FILES = (
    "import json, os, sys\n"
    "for name, text in json.load(sys.stdin).items():\n"
    "    fd = os.open(os.path.join(sys.argv[1], name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)\n"
    "    os.write(fd, text.encode())\n"
    "    os.close(fd)\n"
)
WAITING_SCRIPT = """\
import os, sys, time
deadline = time.time() + 600
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.2)
"""


def command_job(name: str, argv: list[str], priority: int | None = None) -> str:
    text = f'name = "{name}"\ntrainer = "command"\n'
    if priority is not None:
        text += f"priority = {priority}\n"
    return text + f"\n[command]\nargv = {json.dumps(argv)}\n\n[train]\nbatch_size = 1\nmax_steps = 1\n"


def old_style_names(stem: str, suffix: str) -> list[str]:
    """Every name a time-pid-stem scheme gives the foreseeable CLI, and its neighbours."""
    return [f"{FORESEEABLE_TIME}-{pid}-{stem}{suffix}" for pid in range(FORESEEABLE_PID - 1, FORESEEABLE_PID + 2)]


@dataclass
class Box:
    folder: Path
    daemon: Daemon
    accounts: dict[str, Any]

    @property
    def state(self) -> StateDir:
        return StateDir(self.daemon.state_dir)

    def store(self) -> Store:
        return Store(self.state.database, readonly=True)

    def run(self, who: str, *args: str, foreseeable: bool = False, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """`oomguard ARGS` as that user, in their home folder."""
        python = [sys.executable, "-c", FORESEEABLE_CLI] if foreseeable else [sys.executable, "-m", "oomguard.daemon.cli"]
        home = self.folder / who
        return subprocess.run(
            ["runuser", "-u", self.accounts[who].name, "--", *python, "--state-dir", str(self.daemon.state_dir), *args],
            capture_output=True, text=True, timeout=120, cwd=home, env={**os.environ, "HOME": str(home)}, input=stdin,
        )

    def job_file(self, who: str, name: str, priority: int | None = None) -> Path:
        path = self.folder / who / f"{name}.toml"
        path.write_text(command_job(name, [sys.executable, "-c", "pass"], priority))
        shutil.chown(path, self.accounts[who].uid, self.accounts[who].gid)
        return path

    def submit(self, who: str, name: str, priority: int | None = None) -> int:
        result = self.run(who, "submit", str(self.job_file(who, name, priority)))
        assert result.returncode == 0, result.stderr
        return int(re.fullmatch(rf"job (\d+) \({name}\) queued\n", result.stdout).group(1))  # type: ignore[union-attr]

    def bob_makes(self, files: dict[str, str]) -> None:
        result = subprocess.run(
            ["runuser", "-u", self.accounts["bob"].name, "--", sys.executable, "-c", BOB_MAKES_FILES, str(self.state.inbox)],
            input=json.dumps(files), capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 0, result.stderr

    def job(self, job_id: int) -> dict[str, Any]:
        store = self.store()
        try:
            return store.job(job_id)
        finally:
            store.close()

    def recorded(self, names: list[str], table: str) -> list[dict[str, Any]] | None:
        """What the daemon recorded for each of these inbox names (jobs or requests), once it has for all."""
        store = self.store()
        try:
            rows = [store.job_by_spool_file(n) if table == "jobs" else store.request_by_file(n) for n in names]
        finally:
            store.close()
        return rows if all(rows) else None  # type: ignore[return-value]


@pytest.fixture(scope="module")
def box(request: pytest.FixtureRequest) -> Iterator[Box]:
    accounts = request.getfixturevalue("accounts")
    request.getfixturevalue("others_can_run_oomguard")
    folder = Path(tempfile.mkdtemp(prefix="oomguard-spool-security-", dir="/tmp"))
    folder.chmod(0o755)
    for name in ("alice", "bob", "carol"):
        (folder / name).mkdir()
        shutil.chown(folder / name, accounts[name].uid, accounts[name].gid)
    release = folder / "release"
    daemon = Daemon(folder / "state", "--max-parallel", "1", "--admin-group", ADMIN).start()
    try:
        # root's job holds the only slot: every other job stays queued (and trains nothing).
        script = folder / "wait_for_release.py"
        script.write_text(WAITING_SCRIPT)
        script.chmod(0o644)
        blocker = folder / "blocker.toml"
        blocker.write_text(command_job("blocker", [sys.executable, str(script), str(release)], priority=10**6))
        oomguard("submit", str(blocker), state_dir=daemon.state_dir, check=True)
        store = Store(StateDir(daemon.state_dir).database, readonly=True)
        wait_for(lambda: store.job("blocker").state == "running", 60, "root's job to run")
        yield Box(folder=folder, daemon=daemon, accounts=accounts)
    finally:
        if daemon.alive():
            daemon.stop()
        release.touch()
        kill_leftovers(folder)
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------ point 2: spool names


def test_a_submit_under_names_bob_made_first_queues_alices_own_job(box: Box) -> None:
    alice, bob = box.accounts["alice"], box.accounts["bob"]
    squatted = old_style_names("alice-long", ".toml")
    box.bob_makes({name: command_job("bob-squat", [sys.executable, "-c", "pass"]) for name in squatted})
    bobs = wait_for(lambda: box.recorded(squatted, "jobs"), 30, "bob's files to be queued as his jobs")

    result = box.run("alice", "submit", str(box.job_file("alice", "alice-long")), foreseeable=True)
    assert result.returncode == 0, result.stderr
    queued = re.fullmatch(r"job (\d+) \(alice-long\) queued\n", result.stdout)
    assert queued, result.stdout
    job = box.job(int(queued.group(1)))
    assert (job.owner_uid, job.name) == (alice.uid, "alice-long"), "alice's CLI reported a job that is not hers"
    assert job.spool_file not in squatted
    for squat in bobs:  # bob's files are his own jobs, nothing more
        assert (box.job(squat.id).owner_uid, box.job(squat.id).name) == (bob.uid, "bob-squat")


def test_a_cancel_under_names_bob_made_first_gets_alices_own_answer(box: Box) -> None:
    victim = box.submit("alice", "alice-victim")
    squatted = old_style_names(f"cancel-{victim}", ".request")
    box.bob_makes({name: json.dumps({"action": "cancel", "job": str(victim)}) for name in squatted})
    answers = wait_for(lambda: box.recorded(squatted, "requests"), 30, "bob's requests to be answered")
    assert not any(answer.accepted for answer in answers)

    result = box.run("alice", "cancel", str(victim), foreseeable=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == f"cancel requested for job {victim} (alice-victim) by {box.accounts['alice'].name}: the daemon checkpoints and stops it\n"
    assert wait_for(lambda: box.job(victim).state == "cancelled", 30, "alice's job to be cancelled")


def test_bob_replaying_names_alice_used_is_refused(box: Box) -> None:
    alice = box.accounts["alice"]
    replayed = box.submit("alice", "alice-replayed")
    other = box.submit("alice", "alice-other")
    assert box.run("alice", "cancel", str(other)).returncode == 0
    # Names alice's files had are in the store, which every user may read.
    shown = json.loads(box.run("bob", "show", str(replayed), "--json").stdout)
    job_name = shown["spool_file"]
    request_name = box.store().db.execute("select file from requests where requester = ? and job_id = ?", [alice.name, other]).fetchone()[0]
    accepted_copy = box.state.accepted / f"{replayed:06d}-{job_name}"
    before = accepted_copy.read_bytes()

    box.bob_makes({job_name: command_job("bob-replay", [sys.executable, "-c", "pass"]), request_name: json.dumps({"action": "cancel", "job": str(replayed)})})
    errors = [box.state.rejected / f"{name}.error" for name in (job_name, request_name)]
    wait_for(lambda: all(error.exists() for error in errors), 30, "bob's replayed names to be refused")
    assert f"this name was used already, by job {replayed} of {alice.name}" in errors[0].read_text()
    assert f"this name was used already, by a file of {alice.name}" in errors[1].read_text()
    assert "give the file a new name" in errors[1].read_text()
    # alice's job, its file in accepted/ and her answer are as they were.
    job = box.job(replayed)
    assert (job.owner_uid, job.name, job.cancel_requested) == (alice.uid, "alice-replayed", 0)
    assert accepted_copy.read_bytes() == before and accepted_copy.stat().st_uid == alice.uid
    assert box.store().request_by_file(request_name).requester == alice.name
    assert not box.store().db.execute("select 1 from jobs where name = 'bob-replay'").fetchone()


# ------------------------------------------------------------------------------ point 7: names and priority


def test_a_job_of_bob_named_like_alices_does_not_shadow_hers(box: Box) -> None:
    alice, bob = box.accounts["alice"].name, box.accounts["bob"].name
    hers = box.submit("alice", "shared-name")
    his = box.submit("bob", "shared-name")  # newer, same name

    shown = box.run("alice", "show", "shared-name")
    assert shown.returncode == 0 and shown.stdout.startswith(f"job {hers} shared-name (owner {alice})"), shown.stdout + shown.stderr
    assert box.run("alice", "logs", "shared-name").returncode == 0
    shown = box.run("bob", "show", "shared-name")
    assert shown.returncode == 0 and shown.stdout.startswith(f"job {his} shared-name (owner {bob})"), shown.stdout + shown.stderr
    # carol has no job of that name: which of theirs she means, she must say.
    for command in ("show", "cancel", "logs"):
        refused = box.run("carol", command, "shared-name")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"you have no job named 'shared-name', and several other users' jobs are named so: {hers} ({alice}, queued), {his} ({bob}, queued); name the one you mean by its id" in refused.stderr

    cancelled = box.run("alice", "cancel", "shared-name")
    assert cancelled.returncode == 0 and f"cancel requested for job {hers} (shared-name)" in cancelled.stdout, cancelled.stderr
    wait_for(lambda: box.job(hers).state == "cancelled", 30, "alice's job to be cancelled")
    assert (box.job(his).state, box.job(his).cancel_requested) == ("queued", 0)


def test_two_of_your_own_jobs_with_one_name_are_named_by_id(box: Box) -> None:
    first, second = box.submit("alice", "twice"), box.submit("alice", "twice")
    for command in ("show", "cancel"):
        refused = box.run("alice", command, "twice")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"several of your jobs are named 'twice': {first} (queued), {second} (queued); name the one you mean by its id" in refused.stderr
    assert not box.job(first).cancel_requested and not box.job(second).cancel_requested
    assert box.run("alice", "cancel", str(first)).returncode == 0


def test_a_users_priority_is_capped_and_root_and_admins_are_not(box: Box) -> None:
    bob = box.accounts["bob"].name
    greedy = box.run("bob", "submit", str(box.job_file("bob", "bob-greedy", priority=2**63 - 1)))
    assert greedy.returncode == 1, greedy.stdout + greedy.stderr
    assert "refused: bob-greedy-" in greedy.stderr and "queued" not in greedy.stdout
    assert (
        f"priority 9223372036854775807 is above 100, the highest this daemon lets {bob} give a job (only root and members of "
        f"group '{ADMIN}' may go higher); set `priority` to 100 or less in the job file and submit it again, or ask the "
        "administrator to raise the cap (`oomguard daemon --max-user-priority N`)"
    ) in greedy.stderr
    assert not box.store().db.execute("select 1 from jobs where name = 'bob-greedy'").fetchone()

    assert box.job(box.submit("bob", "bob-fair", priority=100)).priority == 100
    assert box.job(box.submit("carol", "carol-admin", priority=5000)).priority == 5000
