"""A real `oomguard serve` for tests: started on a free port of 127.0.0.1 for a state directory,
asked over HTTP as a user would (a token's cookie, or nothing), and stopped at the end."""

from __future__ import annotations

import http.client
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Answer:
    status: int
    body: str
    headers: dict[str, str]


@dataclass(frozen=True)
class Dashboard:
    base_url: str  # "http://127.0.0.1:PORT/"
    socket: Path
    output: Path

    def sign_in(self, token: str) -> str:
        """The session cookie a link's token gets a browser (its first visit)."""
        answer = self.get("/", token=token)
        match = re.search(r"oomguard_session=([^;]+)", answer.headers.get("set-cookie", ""))
        assert answer.status == 303 and match, answer
        return match.group(1)

    def get(self, path: str, token: str | None = None, cookie: str | None = None) -> Answer:
        """GET over TCP; ``token``: as the link's query; ``cookie``: the session a browser sends."""
        parts = urlsplit(self.base_url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        if token is not None:
            path += ("&" if "?" in path else "?") + f"token={token}"
        headers = {"Cookie": f"oomguard_session={cookie}"} if cookie else {}
        try:
            connection.request("GET", path, headers=headers)
            response = connection.getresponse()
            return Answer(response.status, response.read().decode(), {k.lower(): v for k, v in response.getheaders()})
        finally:
            connection.close()


def token_of(url: str) -> str:
    match = re.search(r"[?&]token=([^&\s]+)", url)
    assert match, url
    return match.group(1)


@contextmanager
def serving(state_dir: Path, *extra: str, user: str | None = None) -> Iterator[Dashboard]:
    """`oomguard serve` for ``state_dir`` (as ``user`` through runuser, else as this process)."""
    output = state_dir.parent / f"serve-{time.monotonic_ns()}.out"
    command = [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(state_dir), "serve", "--listen", "127.0.0.1:0", *extra]
    if user is not None:
        command = ["runuser", "-u", user, "--", *command]
    with output.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (match := re.search(r"on (http://127\.0\.0\.1:\d+/) and (\S+)", output.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, output.read_text()
            time.sleep(0.05)
        socket = Path(match.group(2))
        while not socket.exists():
            assert process.poll() is None and time.monotonic() < deadline, output.read_text()
            time.sleep(0.05)
        yield Dashboard(match.group(1), socket, output)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
