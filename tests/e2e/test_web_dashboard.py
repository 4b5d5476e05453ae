"""The dashboard on a lab box: a root daemon running two users' jobs, `oomguard serve` as root,
and each user asking it for their own view, by link (`oomguard web-url`, run as that user) and
through the Unix socket (curl as that user). Everyone sees the queue's rows; a job's progress,
page, rungs, charts and events only its owner, root and the admin group."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ADMIN, as_root
from tests.e2e.conftest import Daemon, wait_for
from tests.e2e.test_lab_box import as_user, heartbeat_step, write_job
from tests.jobs_helpers import TINY_JOB
from tests.web_helpers import serving, token_of

pytestmark = [as_root, pytest.mark.slow]


def tiny(name: str, steps: int) -> str:
    return TINY_JOB.format(name=name, batch_size=8, max_steps=steps, checkpoint_every_steps=20, keep_checkpoints=2) + "\n[ladder]\nprobe = false\n"


def curl_as(user: str, socket: Path, path: str) -> tuple[int, str]:
    """GET over the dashboard's Unix socket as ``user``: the kernel tells the server who asks."""
    done = subprocess.run(
        ["runuser", "-u", user, "--", "curl", "-s", "-w", "\n%{http_code}", "--unix-socket", str(socket), f"http://localhost{path}"],
        capture_output=True, text=True, timeout=60, cwd="/",
    )
    body, _, status = done.stdout.rpartition("\n")
    return int(status), body


def row_of(body: str, job_id: str) -> str:
    match = re.search(rf'<tr class="state-[a-z]+" data-job="{job_id}">(.*?)</tr>', body, re.S)
    assert match, body[-3000:]
    return match.group(1)


def test_each_user_sees_every_row_and_only_their_own_jobs_details(lab: Path, accounts) -> None:
    alice, bob, carol = accounts["alice"], accounts["bob"], accounts["carol"]
    state = lab / "state"
    # Alice's job runs out of room at step 10 (the cap drops) and takes a rung in the process.
    daemon = Daemon(state, "--emulate-device-memory", "64MiB,1MiB@10", "--max-parallel", "2").start()
    try:
        for who, name, steps in (("alice", "alice-private-run", 400), ("bob", "bob-run", 400)):
            job = write_job(lab / who, accounts[who], name, tiny(name, steps))
            submitted = as_user(accounts[who].name, "submit", str(job), state=state, cwd=job.parent)
            assert submitted.returncode == 0, submitted.stderr
        wait_for(lambda: heartbeat_step(daemon.show("1")) >= 12 and heartbeat_step(daemon.show("2")) >= 1, 120, "both jobs to train")
        with serving(state, "--admin-group", ADMIN) as dashboard:
            links = {who: as_user(accounts[who].name, "web-url", state=state, cwd=lab / who) for who in ("alice", "bob", "carol")}
            for who, link in links.items():
                assert link.returncode == 0, link.stderr
                assert token_of(link.stdout).split(".")[0] == str(accounts[who].uid)  # each link names its user
            # Each opens their link: the browser keeps a session.
            alice_token, bob_token, carol_token = (dashboard.sign_in(token_of(links[who].stdout)) for who in ("alice", "bob", "carol"))

            # Bob sees both rows; alice's without a link to its page and without its progress.
            queue = dashboard.get("/", cookie=bob_token)
            assert queue.status == 200 and "signed in as <b>ogtest-bob</b>" in queue.body
            alices_row = row_of(queue.body, "1")
            assert "alice-private-run" in alices_row and "ogtest-alice" in alices_row and "running" in alices_row
            assert 'href="/jobs/1"' not in alices_row and "·/400" in alices_row
            assert 'href="/jobs/2"' in row_of(queue.body, "2")
            # Her page and its live part are refused, saying whose it is, and show none of it.
            for path in ("/jobs/1", "/jobs/1?fragment=1"):
                denied = dashboard.get(path, cookie=bob_token)
                assert denied.status == 403 and "belongs to ogtest-alice" in denied.body, path
                assert "Rungs taken" not in denied.body and "<svg" not in denied.body and "in-process" not in denied.body
            # Through the Unix socket, as bob: the same.
            status, body = curl_as(bob.name, dashboard.socket, "/jobs/1")
            assert status == 403 and "belongs to ogtest-alice" in body
            status, body = curl_as(bob.name, dashboard.socket, "/jobs/2")
            assert status == 200 and "bob-run" in body

            # Alice sees her page: the rung she took, the charts, her progress.
            for page in (dashboard.get("/jobs/1", cookie=alice_token).body, curl_as(alice.name, dashboard.socket, "/jobs/1")[1]):
                assert "signed in as <b>ogtest-alice</b>" in page
                rungs = re.search(r'<ol class="rungs">(.*?)</ol>', page, re.S)
                assert rungs and "in-process" in rungs.group(1), page[-3000:]
                assert "out of memory in forward at step 10" in rungs.group(1)  # the rung's reason
                assert page.count("<svg") == 2 and 'class="mark rung"' in page
            assert dashboard.get("/jobs/2", cookie=alice_token).status == 403
            # A member of the admin group sees every job's page, as root would.
            assert dashboard.get("/jobs/1", cookie=carol_token).status == 200
            assert dashboard.get("/jobs/2", cookie=carol_token).status == 200
            # Bob's session is bob's: he cannot turn it into alice's.
            uid, issued, mac = bob_token.split(".")
            assert dashboard.get("/jobs/1", cookie=f"{alice.uid}.{issued}.{mac}").status == 401
    finally:
        daemon.stop()
