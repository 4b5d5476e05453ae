"""`oomguard serve` against a store written here: who gets in (a link's token, nothing else over
TCP), what a page escapes, and how fast the queue of 10,000 jobs pages. A real daemon's job,
two real users and a real browser: tests/e2e/test_web_dashboard.py and test_web_browser.py."""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import pytest

from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store
from oomguard.jobs.spec import load_job_file
from tests.e2e.conftest import oomguard, tiny_job
from tests.web_helpers import serving, token_of

NASTY = "<script>alert(1)</script>\x1b[2J\u202e"


def fill(tmp_path: Path, jobs: int) -> Path:
    """A state directory whose store holds ``jobs`` jobs (ids 1..jobs): job 1 running with a
    heartbeat, job 2 failed with a result its owner's runner wrote."""
    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    spec = load_job_file(tiny_job(tmp_path)).to_dict()
    plan = load_job_file(tiny_job(tmp_path)).initial_plan().to_dict()
    with store.atomic():
        for i in range(1, jobs + 1):
            store.add_job(name=f"j{i}", owner="root", owner_uid=0, spec=spec, priority=0, workdir=None, plan=plan, spool_file=None, jobs_root=tmp_path / "jobs")
    attempt_dir = tmp_path / "jobs" / "1" / "attempts" / "001"
    attempt_dir.mkdir(parents=True)
    (attempt_dir / "heartbeat.json").write_text(json.dumps({"step": 5, "max_steps": 12, "samples_per_s": 40.0, "peak_bytes": 2**20, "capacity_bytes": 2**21, "plan": "mb=8x1"}))
    store.add_attempt(job_id=1, number=1, plan=json.dumps(plan), directory=str(attempt_dir), started_at=time.time(), pid=None)
    store.update_job(1, state="running")
    store.update_job(2, state="failed", ended_at=time.time(), result=NASTY)
    store.close()
    return state.root


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return fill(tmp_path, 3)


def link_token(state: Path) -> str:
    result = oomguard("web-url", state_dir=state, check=True)
    return token_of(result.stdout)


def signed_in(dashboard, state: Path) -> str:
    """The session a browser keeps after opening this user's link."""
    return dashboard.sign_in(link_token(state))


def test_a_visitor_without_a_link_is_told_how_to_get_one_and_sees_no_job(state: Path) -> None:
    with serving(state) as dashboard:
        for path in ("/", "/jobs/1", "/gpus", "/?page=1"):
            answer = dashboard.get(path)
            assert answer.status == 401, path
            assert "oomguard web-url" in answer.body and "j1" not in answer.body and "j2" not in answer.body
        assert dashboard.get("/token").status == 403  # a link is handed out over the Unix socket only


def test_a_link_becomes_a_session_cookie_and_leaves_the_address_bar(state: Path) -> None:
    with serving(state) as dashboard:
        token = link_token(state)
        answer = dashboard.get("/?page=1", token=token)
        assert answer.status == 303 and answer.headers["location"].endswith("/?page=1") and "token" not in answer.headers["location"]
        cookie = answer.headers["set-cookie"]
        # A session, not the link's token: it expires (a localhost cookie reaches every port of localhost).
        assert "oomguard_session=" in cookie and token not in cookie and "Max-Age=43200" in cookie
        assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
        session = dashboard.sign_in(token)
        page = dashboard.get("/", cookie=session)
        assert page.status == 200 and "signed in as <b>root</b>" in page.body
        assert "default-src 'none'" in page.headers["content-security-policy"] and page.headers["referrer-policy"] == "no-referrer"
        # The running job's progress from its heartbeat; its page is a link.
        row = re.search(r'<tr class="state-running" data-job="1">(.*?)</tr>', page.body, re.S)
        assert row and '<a href="/jobs/1">1</a>' in row.group(1) and "5/12" in row.group(1) and "40.0" in row.group(1)
        # The link's token is no session, and another user's link does not quietly switch a
        # signed-in browser to them (a page elsewhere may send it there).
        assert dashboard.get("/", cookie=token).status == 401
        from oomguard.daemon.paths import StateDir
        from oomguard.daemon.web.tokens import Tokens

        someone_else = Tokens(StateDir(state).secrets / "web.key").token_for(4242)
        switched = dashboard.get(f"/?token={someone_else}", cookie=session)
        assert switched.status == 409 and "another user" in switched.body and "set-cookie" not in switched.headers


def test_a_forged_or_altered_session_or_token_is_refused(state: Path) -> None:
    with serving(state) as dashboard:
        token = link_token(state)
        session = dashboard.sign_in(token)
        uid, issued, mac = session.split(".")
        for forged in (f"{uid}.{issued}.{'0' * 64}", f"1000.{issued}.{mac}", f"{uid}.{int(issued) + 1}.{mac}", f"{uid}.{issued}.{mac[:-1]}",
                       "nonsense", f"{uid}.{issued}.{mac}x", token):
            assert dashboard.get("/", cookie=forged).status == 401, forged
        for forged in (f"{uid}.{'0' * 64}", f"1000.{token.split('.')[1]}", "nonsense", f"{uid}.%C3%A9"):  # the last: "é", as a browser sends it
            assert dashboard.get("/", token=forged).status == 401, forged


def test_what_a_jobs_owner_wrote_is_shown_inert(state: Path) -> None:
    with serving(state) as dashboard:
        session = signed_in(dashboard, state)
        for path in ("/", "/jobs/2", "/?fragment=1"):
            body = dashboard.get(path, cookie=session).body
            assert "<script>alert" not in body and "\x1b" not in body and "\u202e" not in body, path
            assert "&lt;script&gt;alert(1)&lt;/script&gt;\\x1b[2J\\u202e" in body, path


def test_the_server_reads_no_attempt_file_through_a_link_its_owner_planted(tmp_path: Path) -> None:
    """The dashboard reads as root: job 3's heartbeat and metrics are links (to job 1's files,
    which stand for another user's), and it shows neither."""
    state = fill(tmp_path, 3)
    job_1 = tmp_path / "jobs" / "1" / "attempts" / "001"
    (job_1 / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": time.time(), "loss": 0.123456, "peak_bytes": 1}) + "\n")
    planted = tmp_path / "jobs" / "3" / "attempts" / "001"
    planted.mkdir(parents=True)
    (planted / "heartbeat.json").symlink_to(job_1 / "heartbeat.json")
    (planted / "metrics.jsonl").symlink_to(job_1 / "metrics.jsonl")
    store = Store(StateDir(state).database)
    store.add_attempt(job_id=3, number=1, plan="{}", directory=str(planted), started_at=time.time(), pid=None)
    store.update_job(3, state="running")
    store.close()
    with serving(state) as dashboard:
        session = signed_in(dashboard, state)
        queue = dashboard.get("/", cookie=session).body
        assert "5/12" in re.search(r'data-job="1">(.*?)</tr>', queue, re.S).group(1)
        assert "0/12" in re.search(r'data-job="3">(.*?)</tr>', queue, re.S).group(1)  # not job 1's step through the link
        page = dashboard.get("/jobs/3", cookie=session).body
        assert "no steps recorded yet" in page and "0.123" not in page  # job 1's loss, through the link
        assert "<polyline" in dashboard.get("/jobs/1", cookie=session).body  # job 1's own page draws them


def test_pages_and_jobs_that_are_not_there_say_so(state: Path) -> None:
    with serving(state) as dashboard:
        token = signed_in(dashboard, state)
        assert dashboard.get("/?page=0", cookie=token).status == 400
        assert dashboard.get("/?page=x", cookie=token).status == 400
        missing = dashboard.get("/jobs/99", cookie=token)
        assert missing.status == 404 and "No job 99" in missing.body
        assert dashboard.get("/jobs/99999999999999999999999", cookie=token).status == 404
        assert "<h1>" not in dashboard.get("/jobs/1?fragment=1", cookie=token).body  # the live part only


def test_serve_listens_on_loopback_only() -> None:
    for listen in ("0.0.0.0:8470", "192.168.1.5:8470", "example.com:80"):
        result = oomguard("serve", "--listen", listen)
        assert result.returncode == 2 and "is not a loopback address" in result.stderr and "ssh -L" in result.stderr, result.stderr
    bad = oomguard("serve", "--listen", "127.0.0.1:http")
    assert bad.returncode == 2 and "not a port" in bad.stderr


def test_web_url_without_a_dashboard_says_how_to_start_one(tmp_path: Path) -> None:
    result = oomguard("web-url", state_dir=tmp_path / "state")
    assert result.returncode == 1 and "start it with `oomguard serve`" in result.stderr


@pytest.mark.slow
def test_the_queue_of_10000_jobs_loads_in_300_ms_a_page(tmp_path: Path) -> None:
    state = fill(tmp_path, 10_000)
    with serving(state) as dashboard:
        token = signed_in(dashboard, state)
        times: dict[str, list[float]] = {}
        for path in ("/", "/?page=1", "/?page=200", "/?page=200&fragment=1"):
            dashboard.get(path, cookie=token)  # the first of each warms the server's imports
            for _ in range(5):
                started = time.perf_counter()
                answer = dashboard.get(path, cookie=token)
                times.setdefault(path, []).append(time.perf_counter() - started)
                assert answer.status == 200
        last = dashboard.get("/?page=200", cookie=token).body
        assert len(re.findall(r'<tr class="state-', last)) == 50 and 'data-job="10000"' in last and "Page 200 of 200" in last
    medians = {path: statistics.median(seconds) for path, seconds in times.items()}
    print(f"queue of 10,000 jobs, median of 5 loads: {medians}")
    assert max(medians.values()) <= 0.3, medians
