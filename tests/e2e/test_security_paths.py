"""Issue 23, points 1, 4 and 5, end to end: two real users (ogtest-alice, ogtest-bob) and a
daemon running as root in a temp dir, as the README's "Users (system mode)" sets it up. Bob
attacks through the paths of his job files; each attack is refused, he learns nothing about
what only root may see, and alice's submit and cancel keep working.

1. A folder of the job is entered only by its own processes, as bob: [command] cwd into alice's
   attempts, and a workdir swapped for a link into them, get "Permission denied" (the race
   where the daemon entered the workdir as root, before it dropped to bob, is replayed
   deterministically: test_the_daemon_never_enters_a_workdir_for_its_owner).
2. (point 4) A folder above bob's workdir swapped for a link into STATE/jobs after acceptance:
   the daemon reads nothing, never alice's outcome.json.
3. (point 5) Data folders: bob's answer about a folder only root may read is the same whether
   it exists or not; job files naming a huge folder neither stall the daemon's loop (systemd's
   watchdog keeps hearing from it) nor hold up alice's submit.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store
from oomguard.daemon.supervisor import Supervisor
from oomguard.daemon.users import Account
from oomguard.jobs.spec import JobSpec
from oomguard.strategies import doctor
from tests.conftest import as_root
from tests.e2e.conftest import Daemon, kill_leftovers, wait_for

pytestmark = [as_root, pytest.mark.slow]

SLEEP = "import time; print('running', flush=True); time.sleep(600)"


@pytest.fixture
def lab(lab: Path) -> Path:
    """The lab (tests/e2e/conftest.py) with private homes (0700), as real ones are."""
    for name in ("alice", "bob", "carol"):
        (lab / name).chmod(0o700)
    return lab


def run_as(who: Any, *argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", who.name, "--", *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd,
        env={**os.environ, "HOME": str(cwd)},
    )


def cli(who: Any, state: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`oomguard ARGS` as that user, from their home."""
    return run_as(who, sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(state), *args, cwd=cwd)


def command_job(name: str, argv: list[str], *, cwd: Path | None = None, workdir: Path | None = None, extra: str = "") -> str:
    text = f'name = "{name}"\ntrainer = "command"\n'
    if workdir is not None:
        text += f"workdir = {json.dumps(str(workdir))}\n"
    text += f"[command]\nargv = {json.dumps(argv)}\n"
    if cwd is not None:
        text += f"cwd = {json.dumps(str(cwd))}\n"
    return text + f"[train]\nbatch_size = 4\nmax_steps = 10\n[ladder]\ncrash_retries = 0\n{extra}"


def data_job(name: str, source: Path) -> str:
    """A built-in trainer's job that asks for 2 GPUs on a box of one: it is queued, never run."""
    return (
        f'name = "{name}"\ntrainer = "unconditional"\n[data]\nsource = {json.dumps(str(source))}\nresolution = 16\n'
        '[model]\nblock_out_channels = [8, 16]\nlayers_per_block = 1\ndown_block_types = ["DownBlock2D", "DownBlock2D"]\n'
        'up_block_types = ["UpBlock2D", "UpBlock2D"]\nnorm_num_groups = 4\n[train]\nbatch_size = 4\nmax_steps = 2\n'
        "learning_rate = 1e-3\n[resources]\ngpus = 2\n"
    )


def write_as(who: Any, path: Path, text: str) -> Path:
    path.write_text(text)
    os.chown(path, who.uid, who.gid)
    path.chmod(0o600)
    return path


def submit(who: Any, state: Path, home: Path, name: str, text: str) -> subprocess.CompletedProcess[str]:
    return cli(who, state, "submit", str(write_as(who, home / f"{name}.toml", text)), cwd=home)


def drop_in_inbox(who: Any, state: Path, name: str, text: str) -> None:
    """A job file placed in the inbox by hand, past `oomguard submit`'s checks (the inbox is 1733:
    anyone may); owned by `who`, as if they had written it there."""
    write_as(who, state / "spool" / "inbox" / f"{name}.toml", text)


def job_id(submitted: subprocess.CompletedProcess[str]) -> str:
    assert submitted.returncode == 0 and " queued" in submitted.stdout, submitted.stdout + submitted.stderr
    return submitted.stdout.split()[1]


def accepted_job(daemon: Daemon, name: str) -> dict[str, Any]:
    """The job the daemon made of an inbox file dropped by hand (found by its name)."""
    def find() -> dict[str, Any] | None:
        rejected = daemon.state_dir / "spool" / "rejected" / f"{name}.toml.error"
        assert not rejected.exists(), rejected.read_text()
        with sqlite3.connect(f"file:{daemon.state_dir / 'oomguard.db'}?mode=ro", uri=True) as db:
            row = db.execute("select id from jobs where name = ? order by id desc", (name,)).fetchone()
        return daemon.show(str(row[0])) if row else None
    return wait_for(find, 30, f"the daemon to queue {name}")


def victim_still_served(daemon: Daemon, alice: Any, home: Path) -> None:
    """Alice's submit and cancel work as before."""
    submitted = submit(alice, daemon.state_dir, home, "alice-after", command_job("alice-after", [sys.executable, "-c", SLEEP], cwd=home))
    number = job_id(submitted)
    wait_for(lambda: daemon.show(number)["state"] == "running", 60, "alice's job to run")
    cancelled = cli(alice, daemon.state_dir, "cancel", number, cwd=home)
    assert cancelled.returncode == 0 and "cancel requested" in cancelled.stdout, cancelled.stderr
    assert daemon.wait_job(number, timeout=120)["state"] == "cancelled"


# ---------------------------------------------------------------------------------- point 1


def test_bob_cannot_enter_alices_folders_through_his_cwd_or_workdir(lab: Path, accounts) -> None:
    alice, bob = accounts["alice"], accounts["bob"]
    state = lab / "state"
    daemon = Daemon(state, "--max-parallel", "2").start()
    try:
        # Alice's job runs; its attempt folder holds her attempt.json (her command's environment).
        first = job_id(submit(alice, state, lab / "alice", "alice-a", command_job(
            "alice-a", [sys.executable, "-c", SLEEP], cwd=lab / "alice", extra='[command.env]\nALICE_SECRET = "s3cret"\n',
        )))
        attempts = state / "jobs" / first / "attempts"
        wait_for(lambda: (attempts / "001" / "output.log").exists() and "running" in (attempts / "001" / "output.log").read_text(), 60, "alice's job")
        loot = lab / "bob" / "loot"
        steal = [sys.executable, "-c", f"import shutil; shutil.copy('001/attempt.json', {str(loot)!r})"]

        # (a) cwd = alice's attempts: `submit` looks as bob and says only that he cannot look,
        # the same for a folder there that does not exist.
        refused = submit(bob, state, lab / "bob", "bob-cwd", command_job("bob-cwd", steal, cwd=attempts))
        missing = submit(bob, state, lab / "bob", "bob-cwd2", command_job("bob-cwd2", steal, cwd=attempts.parent / "nothing"))
        assert refused.returncode == 2 and f'command.cwd: cannot look at folder "{attempts}": Permission denied' in refused.stderr
        assert missing.stderr.replace(str(attempts.parent / "nothing"), str(attempts)).replace("bob-cwd2", "bob-cwd") == refused.stderr
        # Dropped in by hand, past submit: the daemon does not look; the attempt enters it as bob.
        drop_in_inbox(bob, state, "bob-cwd", command_job("bob-cwd", steal, cwd=attempts))
        record = daemon.wait_job(str(accepted_job(daemon, "bob-cwd")["id"]), timeout=120)
        assert record["state"] == "failed" and "Permission denied" in record["result"] and str(attempts) in record["result"], record["result"]

        # (b) A workdir of bob's, swapped for a link to alice's attempts after the daemon made it,
        # before its attempt starts (bob's other job holds the second slot until then).
        holder = job_id(submit(bob, state, lab / "bob", "bob-hold", command_job("bob-hold", [sys.executable, "-c", SLEEP], cwd=lab / "bob")))
        wait_for(lambda: daemon.show(holder)["state"] == "running", 60, "bob's first job")
        workdir = lab / "bob" / "w"
        swapped = job_id(submit(bob, state, lab / "bob", "bob-w", command_job(
            "bob-w", [sys.executable, "-c", "import os, shutil; print(os.getcwd()); " + steal[2].removeprefix("import shutil; ")], workdir=workdir,
        )))
        assert daemon.show(swapped)["state"] == "queued" and workdir.is_dir()
        assert run_as(bob, "mv", str(workdir), str(lab / "bob" / "w.real"), cwd=lab / "bob").returncode == 0
        assert run_as(bob, "ln", "-s", str(attempts), str(workdir), cwd=lab / "bob").returncode == 0
        assert cli(bob, state, "cancel", holder, cwd=lab / "bob").returncode == 0
        record = daemon.wait_job(swapped, timeout=120)
        assert record["state"] == "failed", record
        (attempt,) = record["attempts"]
        assert attempt["outcome"]["message"].startswith(f"the attempt could not enter its workdir {workdir} or make its folder there as {bob.name}")
        assert not loot.exists(), "bob copied alice's attempt record"

        cancelled = cli(alice, state, "cancel", first, cwd=lab / "alice")
        assert cancelled.returncode == 0, cancelled.stderr
        assert daemon.wait_job(first, timeout=120)["state"] == "cancelled"
        victim_still_served(daemon, alice, lab / "alice")
    finally:
        daemon.stop()


def test_the_daemon_never_enters_a_workdir_for_its_owner(open_tmp: Path, accounts, others_can_run_oomguard, monkeypatch) -> None:
    """The race of point 1, replayed deterministically with the daemon's own Supervisor, as root:
    bob's workdir is a link into alice's attempts while his shim is started, and his real folder
    again by the time the shim looks at it. A daemon that let Popen enter the workdir (cwd=,
    entered with root's rights, before the switch to bob) left bob's command running in alice's
    folder; now the shim starts in / and enters the workdir itself, as bob."""
    monkeypatch.setattr(doctor, "CRASH_BACKOFF_SECONDS", 0.0)
    alice, bob = accounts["alice"], accounts["bob"]
    state = StateDir(open_tmp / "state").create()
    store = Store(state.database)
    supervisor = Supervisor(state, store, max_parallel=1)
    try:
        hers = supervisor.add_job(JobSpec.parse({
            "name": "alice-a", "trainer": "command", "train": {"batch_size": 4, "max_steps": 3},
            "command": {"argv": [sys.executable, "-c", "print('alice-secret-output')"], "cwd": "/"},
        }), alice)
        wait_for(lambda: (supervisor.tick(), supervisor.job_done(hers))[1], 60, "alice's job", interval=0.05)
        alices_attempts = Path(store.job(hers).workdir) / "attempts"
        assert "alice-secret-output" in (alices_attempts / "001" / "output.log").read_text()

        home = open_tmp / "bob"
        home.mkdir(mode=0o700)
        os.chown(home, bob.uid, bob.gid)
        loot = home / "loot"
        steal = f"import os, shutil; print(os.getcwd(), flush=True); shutil.copy('001/output.log', {str(loot)!r})"
        workdir = home / "w"
        his = supervisor.add_job(JobSpec.parse({
            "name": "bob-w", "trainer": "command", "workdir": str(workdir), "train": {"batch_size": 4, "max_steps": 3},
            "command": {"argv": [sys.executable, "-c", steal]}, "ladder": {"crash_retries": 0},
        }), bob)
        real = home / "w.real"
        workdir.rename(real)
        workdir.symlink_to(alices_attempts)
        os.lchown(workdir, bob.uid, bob.gid)
        popen = subprocess.Popen

        def start_then_swap_back(argv: Any, *args: Any, **kwargs: Any) -> Any:
            process = popen(argv, *args, **kwargs)
            if "oomguard.daemon.shim" in argv and workdir.is_symlink():
                # The shim has been exec'ed (Popen returns after exec) and waits for its
                # configuration on stdin: bob puts his real folder back.
                workdir.unlink()
                real.rename(workdir)
            return process

        monkeypatch.setattr(subprocess, "Popen", start_then_swap_back)  # the launcher's Popen (daemon/launch/local.py)
        wait_for(lambda: (supervisor.tick(), supervisor.job_done(his))[1], 60, "bob's job", interval=0.05)
        log = (workdir / "attempts" / "001" / "output.log").read_text()
        assert not loot.exists(), f"bob's command ran in alice's folder and copied her log: {log}"
        assert log.startswith(f"{workdir}\n"), log  # it ran in his own workdir, entered as bob
        assert store.job(his).state == "failed"  # no 001/output.log there
    finally:
        store.close()
        kill_leftovers(open_tmp)


# ---------------------------------------------------------------------------------- point 4


def test_a_folder_above_bobs_workdir_swapped_for_a_link_makes_the_daemon_read_nothing(lab: Path, accounts) -> None:
    alice, bob = accounts["alice"], accounts["bob"]
    state = lab / "state"
    daemon = Daemon(state).start()
    try:
        # Alice's job 1 ends, leaving STATE/jobs/1/attempts/001/outcome.json (and exit.json).
        report = (
            "import json, os; json.dump(dict(kind='finished', step=4242, message='alice-only'), "
            "open(os.path.join(os.environ['OOMGUARD_ATTEMPT_DIR'], 'outcome.json'), 'w'))"
        )
        first = job_id(submit(alice, state, lab / "alice", "alice-a", command_job("alice-a", [sys.executable, "-c", report], cwd=lab / "alice")))
        assert first == "1"
        assert daemon.wait_job(first, timeout=120)["state"] == "finished"
        assert json.loads((state / "jobs" / "1" / "attempts" / "001" / "outcome.json").read_text())["step"] == 4242

        # Bob's workdir is HOME/p/1; once his attempt runs, he swaps p for a link to STATE/jobs,
        # so that the path names alice's workdir, and ends without a report.
        parent = lab / "bob" / "p"
        swap = (
            f"import os; os.rename({str(parent)!r}, {str(parent) + '.real'!r}); "
            f"os.symlink({str(state / 'jobs')!r}, {str(parent)!r}); raise SystemExit(3)"
        )
        second = job_id(submit(bob, state, lab / "bob", "bob-swap", command_job(
            "bob-swap", [sys.executable, "-c", swap], cwd=lab / "bob", workdir=parent / "1",
        )))
        record = daemon.wait_job(second, timeout=120)
        (attempt,) = record["attempts"][:1]
        assert attempt["outcome"]["kind"] == "crashed", attempt["outcome"]
        assert attempt["outcome"]["step"] != 4242 and "alice-only" not in json.dumps(record)
        assert attempt["outcome"]["message"].startswith(
            f"the attempt ended, but its folder {parent / '1' / 'attempts' / '001'} cannot be opened as {bob.name}'s without following "
            "a symbolic link"
        ) and "read nothing" in attempt["outcome"]["message"]
        assert record["state"] == "failed"
        # Alice's record is untouched, and she is served as before.
        assert daemon.show(first)["state"] == "finished"
        victim_still_served(daemon, alice, lab / "alice")
    finally:
        daemon.stop()


# ---------------------------------------------------------------------------------- point 5


def test_bob_learns_nothing_about_a_folder_only_root_may_read(lab: Path, accounts) -> None:
    alice, bob = accounts["alice"], accounts["bob"]
    state = lab / "state"
    private = lab / "private"  # root's, 0700: bob may not search it
    (private / "imgs").mkdir(parents=True)
    private.chmod(0o700)
    (private / "imgs" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    daemon = Daemon(state, "--emulate-gpus", "1x64MiB").start()
    try:
        there = submit(bob, state, lab / "bob", "bob-d", data_job("bob-d", private / "imgs"))
        not_there = submit(bob, state, lab / "bob", "bob-d", data_job("bob-d", private / "none"))
        assert there.returncode == not_there.returncode == 2
        assert there.stderr.replace("imgs", "none") == not_there.stderr
        assert f'data.source: cannot look at folder "{private / "imgs"}": Permission denied' in there.stderr
        assert "give a folder you can read" in there.stderr
        # Past submit, by hand: the daemon (root) does not look at bob's paths, so both are queued
        # the same way; his own processes would look, as him.
        drop_in_inbox(bob, state, "bob-imgs", data_job("bob-imgs", private / "imgs"))
        drop_in_inbox(bob, state, "bob-none", data_job("bob-none", private / "none"))
        records = [accepted_job(daemon, name) for name in ("bob-imgs", "bob-none")]
        records = [wait_for(lambda r=r: (again := daemon.show(str(r["id"])))["waiting"] and again, 30, "the job to wait") for r in records]
        assert [r["state"] for r in records] == ["queued", "queued"]
        assert records[0]["waiting"] == records[1]["waiting"] and "2 GPU" in records[0]["waiting"]
        for record in records:
            cancelled = cli(bob, state, "cancel", str(record["id"]), cwd=lab / "bob")
            assert cancelled.returncode == 0, cancelled.stderr
        victim_still_served(daemon, alice, lab / "alice")
    finally:
        daemon.stop()


class WatchdogListener:
    """systemd's end of sd_notify: a datagram socket, and when each message came."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self.running = True
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while self.running:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def pings(self, since: float) -> list[float]:
        return [at for at, text in self.messages if "WATCHDOG=1" in text and at >= since]

    def close(self) -> None:
        self.running = False
        self.thread.join(timeout=5)
        self.sock.close()


def test_job_files_naming_a_huge_folder_neither_stall_the_daemon_nor_alices_submit(lab: Path, accounts) -> None:
    alice, bob = accounts["alice"], accounts["bob"]
    state = lab / "state"
    state.mkdir()
    # A folder of 60,000 files, none an image, readable by everyone.
    huge = lab / "huge"
    huge.mkdir()
    for number in range(60_000):
        os.close(os.open(huge / f"caption-{number:06d}.txt", os.O_CREAT | os.O_WRONLY, 0o644))
    listener = WatchdogListener(lab / "notify.sock")
    environment = {**os.environ, "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "2000000"}  # a ping a second
    output = (state / "daemon.out").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(state), "daemon", "--poll-interval", "0.1", "--emulate-gpus", "1x64MiB"],
        stdout=output, stderr=subprocess.STDOUT, env=environment,
    )
    try:
        wait_for(lambda: any("READY=1" in text for _, text in listener.messages), 60, "the daemon to be ready")
        # bob's `oomguard submit` of such a job answers at once (the look at the folder is bounded).
        began = time.monotonic()
        job_id(submit(bob, state, lab / "bob", "bob-huge", data_job("bob-huge", huge)))
        assert time.monotonic() - began < 20
        # 60 files of the daemon's own user (root: the daemon checks their paths, as root) and 20
        # of bob's, dropped at once, then alice submits.
        for number in range(60):
            drop_in_inbox(Account.current(), state, f"root-{number:02d}", data_job(f"root-{number:02d}", huge))
        for number in range(20):
            drop_in_inbox(bob, state, f"bob-{number:02d}", data_job(f"bob-{number:02d}", huge))
        dropped = time.monotonic()
        submitted = submit(alice, state, lab / "alice", "alice-a", command_job("alice-a", [sys.executable, "-c", SLEEP], cwd=lab / "alice"))
        answered = time.monotonic() - dropped
        number = job_id(submitted)
        assert answered < 10, f"alice's submit waited {answered:.1f} s"
        wait_for(lambda: len(list((state / "spool" / "accepted").iterdir())) >= 82, 60, "the daemon to take every file")
        # The longest time without a ping from the drop until now (a daemon that took every file
        # within a second has pinged no more since: that too is a gap, not an empty list).
        marks = [dropped, *listener.pings(since=dropped), time.monotonic()]
        longest = max(b - a for a, b in zip(marks, marks[1:]))
        assert longest < 5.0, f"the watchdog went {longest:.1f} s without a ping (WatchdogSec 2 s)"
        assert not list((state / "spool" / "rejected").glob("*.error")), "a bounded look decides nothing: none is refused"
        cancelled = cli(alice, state, "cancel", number, cwd=lab / "alice")
        assert cancelled.returncode == 0 and "cancel requested" in cancelled.stdout, cancelled.stderr
    finally:
        process.terminate()
        process.wait(timeout=60)
        output.close()
        listener.close()
