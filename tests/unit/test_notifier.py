"""The notifier delivers through apprise to a real HTTP server on 127.0.0.1 (json:// URLs)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import apprise
import pytest

from oomguard.daemon.notifier import Notifier
from oomguard.daemon.notify_config import default_config_paths
from oomguard.daemon.notify_message import DEFAULT_EVENTS, EVENTS, JobFacts, compose
from oomguard.daemon.notify_redact import redact_text, redact_url

MiB, GiB = 1024**2, 1024**3

# apprise imports the deprecated imghdr (in apprise/utils/pgp.py) the first time it sends.
pytestmark = pytest.mark.filterwarnings("ignore:'imghdr' is deprecated:DeprecationWarning")


def facts(**changes) -> JobFacts:
    base = dict(
        job_id=3,
        job_name="sd-lora",
        user="alice",
        event="failed",
        attempts=4,
        plan="mb=4x4 ckpt",
        step=120,
        max_steps=1000,
        peak_bytes=3 * GiB + GiB // 2,
        cap_bytes=4 * GiB,
        summary="ladder exhausted at step 120: activations need 5.1 GiB",
        next_step="nothing: the job has ended; fix the batch size and resubmit",
        gpus="0,1",
    )
    base.update(changes)
    return JobFacts(**base)


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Recorder:
    """A JSON endpoint on 127.0.0.1 that records every POST: (path, payload)."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                received.append((self.path, json.loads(self.rfile.read(length) or b"{}")))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:  # keep the test output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,), name="test-http", daemon=True)
        self.thread.start()

    def url(self, path: str = "hook") -> str:
        return f"json://127.0.0.1:{self.port}/{path}"

    def paths(self) -> list[str]:
        return [path for path, _ in self.received]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture(autouse=True)
def no_leftover_threads():
    """Like watchdog's tests: a test that leaves a thread behind fails."""
    before = set(threading.enumerate())
    yield
    leftover = lambda: [t for t in threading.enumerate() if t not in before and t.is_alive()]  # noqa: E731
    wait_until(lambda: not leftover(), timeout=2.0)
    assert not leftover(), f"threads left running: {leftover()}"


@pytest.fixture
def server():
    recorder = Recorder()
    yield recorder
    recorder.close()


@pytest.fixture
def dead_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def make_notifier():
    made: list[Notifier] = []
    lines: list[str] = []

    def make(**kwargs) -> Notifier:
        kwargs.setdefault("config_paths", [])
        kwargs.setdefault("log", lines.append)
        notifier = Notifier(**kwargs)
        notifier.lines = lines  # the test reads what it logged
        made.append(notifier)
        return notifier

    yield make
    for notifier in made:
        notifier.close(timeout=5)


def test_events_constants():
    assert EVENTS == ("failed", "finished", "escalated", "stalled", "waiting_for_disk", "creep")
    assert DEFAULT_EVENTS == ("failed", "finished", "stalled", "waiting_for_disk", "creep")


def test_compose_says_what_happened_and_what_next():
    title, body = compose(facts())
    assert title == "oomguard: job 3 (sd-lora) failed"
    lines = body.splitlines()
    assert lines == [
        "job: 3 (sd-lora)",
        "user: alice",
        "event: failed",
        "attempts: 4",
        "plan: mb=4x4 ckpt",
        "step: 120 of 1000",
        "memory: peak 3.50 GiB of cap 4.00 GiB",
        "GPUs: 0,1",
        "what happened: ladder exhausted at step 120: activations need 5.1 GiB",
        "what next: nothing: the job has ended; fix the batch size and resubmit",
    ]


def test_compose_unknown_fields():
    _, body = compose(facts(step=None, max_steps=None, peak_bytes=None, cap_bytes=48 * MiB, gpus=""))
    assert "step: unknown" in body.splitlines()
    assert "memory: cap 48.00 MiB" in body.splitlines()
    assert "GPUs: none" in body.splitlines()
    _, body = compose(facts(peak_bytes=None, cap_bytes=None))
    assert "memory: not measured" in body.splitlines()


def test_finished_and_failed_arrive(server, make_notifier):
    notifier = make_notifier()
    assert notifier.notify(facts(event="finished", summary="done at step 1000"), urls=[server.url("a")])
    assert notifier.notify(facts(event="failed"), urls=[server.url("b")])
    assert notifier.flush(10)
    assert sorted(server.paths()) == ["/a", "/b"]
    payloads = {path: payload for path, payload in server.received}
    assert payloads["/a"]["title"] == "oomguard: job 3 (sd-lora) finished"
    assert payloads["/a"]["type"] == "success"
    assert payloads["/b"]["title"] == "oomguard: job 3 (sd-lora) failed"
    assert payloads["/b"]["type"] == "failure"
    body = payloads["/b"]["message"]
    for needle in ("job: 3 (sd-lora)", "user: alice", "attempts: 4", "plan: mb=4x4 ckpt",
                   "peak 3.50 GiB of cap 4.00 GiB", "what next: nothing: the job has ended"):
        assert needle in body
    assert notifier.lines == []


def test_escalated_is_opt_in(server, make_notifier):
    notifier = make_notifier()
    assert not notifier.notify(facts(event="escalated"), urls=[server.url("default")])
    assert notifier.notify(facts(event="escalated"), urls=[server.url("opted")], events=EVENTS)
    assert not notifier.notify(facts(event="finished"), urls=[server.url("not-wanted")], events=("failed",))
    assert notifier.flush(10)
    assert server.paths() == ["/opted"]


def test_duplicates_are_throttled_then_sent_again(server, make_notifier):
    now = [1000.0]
    notifier = make_notifier(throttle_seconds=600, clock=lambda: now[0])
    url = [server.url()]
    assert notifier.notify(facts(), urls=url)
    now[0] += 599
    assert not notifier.notify(facts(), urls=url)
    assert any("suppressed duplicate" in line and "job 3" in line for line in notifier.lines)
    # A different summary or event is news, not a duplicate.
    assert notifier.notify(facts(summary="crashed: CUDA error"), urls=url)
    assert notifier.notify(facts(event="stalled"), urls=url)
    now[0] += 1  # 600 s after the first: the window is over
    assert notifier.notify(facts(), urls=url)
    assert notifier.flush(10)
    assert len(server.received) == 4


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("fmt", ["yaml", "text"])
def test_global_config_selects_servers_by_tag(server, make_notifier, tmp_path, fmt):
    u = server.url
    if fmt == "yaml":
        config = write(tmp_path / "apprise.yml", f"""
urls:
  - {u("untagged")}
  - {u("ops")}:
      - tag: ops
  - {u("gpu-ops")}:
      - tag: ops, gpu
  - {u("team")}:
      - tag: team
""")
    else:
        config = write(tmp_path / "apprise.conf", f"""
# oomguard's servers
{u("untagged")}
ops={u("ops")}
ops,gpu={u("gpu-ops")}
team={u("team")}
""")
    notifier = make_notifier(config_paths=[config])
    assert notifier.lines == []

    def sent(**kwargs) -> list[str]:
        server.received.clear()
        assert notifier.notify(facts(summary=repr(kwargs)), **kwargs)
        assert notifier.flush(10)
        return sorted(server.paths())

    assert sent() == ["/untagged"]  # no tags: apprise's default, untagged entries only
    assert sent(tags=["ops"]) == ["/gpu-ops", "/ops"]
    assert sent(tags=["team", "gpu"]) == ["/gpu-ops", "/team"]  # items are alternatives
    assert sent(tags=["ops, gpu"]) == ["/gpu-ops"]  # one item: all its tags
    assert sent(tags=["nobody"]) == []
    assert sent(tags=["team"], urls=[u("own")]) == ["/own", "/team"]
    assert sent(urls=[u("untagged")]) == ["/untagged"]  # configured and own: sent once


def test_no_target_is_logged_once_per_job(make_notifier):
    notifier = make_notifier()
    assert notifier.notify(facts(summary="one"))
    assert notifier.notify(facts(summary="two"))
    assert notifier.notify(facts(job_id=4, summary="one"))
    assert notifier.flush(10)
    told = [line for line in notifier.lines if "no notification target" in line]
    assert len(told) == 2
    assert "job 3" in told[0] and "job 4" in told[1]


def test_dead_endpoint_is_retried_then_given_up_without_leaking_secrets(server, make_notifier, dead_port):
    notifier = make_notifier(retry_delays=(0.05, 0.1))
    dead = f"json://user:secret@127.0.0.1:{dead_port}/hook?-X-Token=tok-abcdef"
    started = time.monotonic()
    assert notifier.notify(facts(), urls=[dead])
    assert time.monotonic() - started < 0.5  # notify() never waits for the network
    # While the dead server waits for its retries, another job's first try is not held up.
    assert notifier.notify(facts(job_id=5, event="finished"), urls=[server.url("other")])
    assert wait_until(lambda: server.paths() == ["/other"], timeout=5)
    assert notifier.flush(10)

    failures = [line for line in notifier.lines if "failed (try" in line]
    assert len(failures) == 2
    assert "try 1 of 3" in failures[0] and "retrying in 0.05s" in failures[0]
    assert "try 2 of 3" in failures[1] and "retrying in 0.1s" in failures[1]
    assert any("gave up" in line and "after 3 tries" in line for line in notifier.lines)
    assert all(f"127.0.0.1:{dead_port}" in line for line in failures)
    assert all("user:****@" in line for line in failures)  # named, with the password masked
    for line in notifier.lines:
        assert "secret" not in line, line
        assert "tok-abcdef" not in line, line


def test_close_logs_pending_retries_as_dropped_and_joins(server, make_notifier, dead_port):
    notifier = make_notifier(retry_delays=(60.0,))
    assert notifier.notify(facts(), urls=[f"json://user:secret@127.0.0.1:{dead_port}/x"])
    assert wait_until(lambda: any("failed (try 1 of 2)" in line for line in notifier.lines))
    # A retry waiting its 60 s holds up nobody else.
    assert notifier.notify(facts(job_id=7, event="finished"), urls=[server.url("seven")])
    assert wait_until(lambda: server.paths() == ["/seven"], timeout=5)
    assert not notifier.flush(0.05)  # a retry waiting counts as pending
    notifier.close(timeout=5)
    assert not any(t.name == "oomguard-notifier" and t.is_alive() for t in threading.enumerate())
    dropped = [line for line in notifier.lines if "dropped" in line]
    assert len(dropped) == 1 and "retry pending" in dropped[0] and "secret" not in dropped[0]
    assert not notifier.notify(facts(event="stalled"), urls=["json://127.0.0.1:1/x"])  # closed


def test_apprise_raising_is_a_failure_and_its_message_is_redacted(make_notifier, monkeypatch):
    url = "json://user:secret@127.0.0.1:9/hook?+token=abcd1234"

    def explode(self, *args, **kwargs):  # e.g. a requests error that quotes the URL
        raise RuntimeError(f"cannot post to {url} (token abcd1234)")

    monkeypatch.setattr(apprise.Apprise, "notify", explode)
    notifier = make_notifier(retry_delays=(0.01,))
    assert notifier.notify(facts(), urls=[url])
    assert notifier.flush(10)
    assert len(notifier.lines) == 2
    assert "failed (try 1 of 2)" in notifier.lines[0] and "gave up" in notifier.lines[1]
    assert all("RuntimeError" in line and "json://user:****@127.0.0.1:9/****" in line for line in notifier.lines)
    for line in notifier.lines:
        assert "secret" not in line and "abcd1234" not in line and "/hook" not in line, line


def test_close_still_sends_what_was_queued(server, make_notifier):
    notifier = make_notifier()
    assert notifier.notify(facts(event="failed"), urls=[server.url("last-words")])
    notifier.close(timeout=10)
    assert server.paths() == ["/last-words"]


def test_close_joins_the_worker(make_notifier):
    notifier = make_notifier()
    assert any(t.name == "oomguard-notifier" for t in threading.enumerate())
    notifier.close()
    assert not any(t.name == "oomguard-notifier" for t in threading.enumerate())
    notifier.close()  # twice is harmless


def test_missing_and_broken_config_are_reported(server, make_notifier, tmp_path):
    missing = tmp_path / "nope" / "apprise.yml"
    broken = write(tmp_path / "broken.yml", "urls: [unclosed\n")
    good = write(tmp_path / "good.conf", server.url("good") + "\n")
    notifier = make_notifier(config_paths=[missing, broken, good])
    assert len(notifier.lines) == 2
    assert str(missing) in notifier.lines[0] and "does not exist" in notifier.lines[0]
    assert str(broken) in notifier.lines[1] and "fix it" in notifier.lines[1]
    assert notifier.notify(facts())  # the good file still works
    assert notifier.flush(10)
    assert server.paths() == ["/good"]


def test_config_secrets_stay_out_of_logs(make_notifier, tmp_path, dead_port):
    config = write(tmp_path / "apprise.conf", f"json://admin:hunter22@127.0.0.1:{dead_port}/x\n")
    notifier = make_notifier(config_paths=[config], retry_delays=())
    assert notifier.notify(facts())
    assert notifier.flush(10)
    assert any("gave up" in line for line in notifier.lines)
    assert not any("hunter22" in line for line in notifier.lines)


def test_bad_job_url_is_reported_redacted(make_notifier):
    notifier = make_notifier()
    assert notifier.notify(facts(), urls=["jsno://user:secret@127.0.0.1/x"])
    assert notifier.flush(10)
    bad = [line for line in notifier.lines if "not usable" in line]
    assert len(bad) == 1 and "jsno://…" in bad[0]
    assert not any("secret" in line for line in notifier.lines)


def test_apprise_says_nothing_on_stdout(capsys, make_notifier, dead_port):
    notifier = make_notifier(retry_delays=())
    assert notifier.notify(facts(), urls=[f"json://127.0.0.1:{dead_port}/x", "garbage://x"])
    assert notifier.flush(10)
    redact_url("not a url")
    out, err = capsys.readouterr()
    assert out == "" and err == ""


@pytest.mark.parametrize(
    ("url", "secrets", "keeps"),
    [
        ("json://user:secret@127.0.0.1:8080/hook", ["secret", "hook"], ["json://user:****@127.0.0.1:8080/****"]),
        ("jsons://example.com/hook?-Authorization=Bearer%20tok12345", ["tok12345", "hook"], ["jsons://example.com/****"]),
        # A webhook's token is its path, or a query value apprise keeps.
        ("json://hooks.example.com/T0KENPATH/more?token=QT0KEN", ["T0KENPATH", "QT0KEN", "more"], ["json://hooks.example.com/****/****"]),
        ("form://host/path/SECRET?:field=F1ELDSECRET", ["SECRET", "F1ELDSECRET"], ["form://host/"]),
        ("ntfy://ntfy.sh/my-secret-topic", ["my-secret-topic"], ["ntfy://ntfy.sh/****"]),
        ("json://T0KENASUSER@hooks.example.com/x", ["T0KENASUSER"], ["json://****@hooks.example.com/"]),
        ("mailto://alice:pa55word@gmail.com", ["pa55word"], ["alice:****@gmail.com"]),
        ("mailtos://bob:pa55word@example.com?smtp=smtp.example.com&to=ops@example.com", ["pa55word"], ["mailtos://"]),
        ("discord://123456789012/abcdefghijklmnopqrstuvwxyzABCDEFGHIJ", ["abcdefghijklmnopqrstuvwxyz", "123456789012"], ["discord://"]),
        ("https://discord.com/api/webhooks/123456789012/abcdefghijklmnopqrstuvw", ["abcdefghijklmnopq"], ["discord://"]),
        ("slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ/#general", ["TIiajkdnlazkcOXrIdevi7FQ", "A1BRTD4JD"], ["slack://"]),
        ("tgram://123456789:AAbcdefghijklmnopqrstuvwxyz012345678/12345", ["AAbcdefghijkl"], ["tgram://"]),
    ],
)
def test_redact_url_hides_secrets(url, secrets, keeps):
    redacted = redact_url(url)
    for secret in secrets:
        assert secret not in redacted
    for kept in keeps:
        assert kept in redacted


@pytest.mark.parametrize(
    ("url", "expected"),
    [("jsno://user:secret@host/x", "jsno://…"), ("foo://bar", "foo://…"), ("no scheme at all", "…")],
)
def test_redact_url_unparseable(url, expected):
    assert redact_url(url) == expected


def test_redact_text():
    url = "json://user:secret@127.0.0.1:9/hook"
    text = f"sending to {url} failed; password secret rejected; other json://127.0.0.1:9/ok"
    redacted = redact_text(text, [url, "mailto://a:b@c.d"])
    assert "secret" not in redacted
    assert redacted.startswith("sending to json://user:****@127.0.0.1:9/****?")
    assert "other json://127.0.0.1:9/ok" in redacted
    # A URL nobody named still loses its password.
    assert redact_text("bad line xyz://a:p4ssw0rd@b", []) == "bad line xyz://a:****@b"
    assert redact_text("nothing to hide", []) == "nothing to hide"


def test_default_config_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("APPRISE_CONFIG_PATH", raising=False)
    (tmp_path / ".config").mkdir()
    conf = write(tmp_path / ".config" / "apprise.yml", "urls: []\n")
    (tmp_path / ".apprise").mkdir()  # a folder (apprise's plugin home) is not a config file
    found = default_config_paths()
    assert conf in found
    assert all(path.is_file() for path in found)
    assert tmp_path / ".apprise" not in found
    monkeypatch.setenv("APPRISE_CONFIG_PATH", f"{conf};{tmp_path / 'missing.yml'}")
    assert default_config_paths() == [conf]


def test_redact_text_does_not_redact_twice():
    url = "json://127.0.0.1:9/dead"
    redacted = redact_url(url)
    assert redacted.startswith("json://127.0.0.1:9/****?")  # apprise adds its defaults
    line = f"to {redacted}, then to {url}"
    assert redact_text(line, [url]) == f"to {redacted}, then to {redacted}"
