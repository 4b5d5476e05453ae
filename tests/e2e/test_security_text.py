"""Issue 23, points 3 and 6, as two real users against a real root daemon in a temp folder:
bob never reads alice's [command.env] values or her webhook's secrets (the store, its WAL,
`show`, `status`, the daemon's log, attempt files, anything under the state and job folders
he can open), and alice's own text (an outcome.json message with a newline, ESC sequences and
a bidi override) cannot write a line into the daemon's log or reach a terminal raw. The jobs
of both still run, and each can still submit and cancel their own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import as_root
from tests.e2e.conftest import Daemon, oomguard, wait_for
from tests.e2e.test_lab_box import as_user, write_job
from tests.e2e.test_notifications import Endpoint, dead_port
from tests.web_helpers import serving, token_of

pytestmark = [as_root, pytest.mark.slow]

SECRETS = {"HF_TOKEN": "hf_AliceTokenS3CRET", "WANDB_API_KEY": "wandbKeyS3CRET", "DATABASE_URL": "postgres://al:DbPassS3CRET@db/x"}
HOOK_SECRET, QUERY_SECRET, PASSWORD_SECRET, DEAD_SECRET = "HookPathS3CRET", "QueryTokS3CRET", "MailPwS3CRET", "DeadPathS3CRET"
EVERY_SECRET = [*SECRETS.values(), "DbPassS3CRET", HOOK_SECRET, QUERY_SECRET, PASSWORD_SECRET, DEAD_SECRET]
# What alice's runner reports as its message: a fake daemon log line about bob's job, terminal
# escapes (erase line, retitle, bell, recolour), a carriage return, a bidi override and console markup.
FAKE_RECORD = "[12:00:00] job 1 bob-victim: cancelled: cancelled by root"
EVIL_MESSAGE = f"loss is nan\n{FAKE_RECORD}\x1b[2K\x1b]0;owned\x07\r\x1b[31m\u202etxt.exe [/bold] $\\frac{{$"
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")  # all but the newline

WAITING = """\
import os, sys, time
deadline = time.time() + 120
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.2)
"""
# Alice's command: records the environment it was given (only she can read the file), then ends.
RECORDING = """\
import json, os, sys
descriptor = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(descriptor, "w") as handle:
    json.dump({name: os.environ.get(name) for name in sys.argv[2:]}, handle)
print("done")
"""
# Alice's command that reports a diverged loss with her own message, the way a runner writes outcome.json.
REPORTING = """\
import json, os, sys
attempt = os.path.join(sys.argv[1], "attempts", "%03d" % int(sys.argv[2]))
with open(os.path.join(attempt, "outcome.json"), "w") as handle:
    json.dump({"kind": "diverged", "step": 0, "message": sys.argv[3]}, handle)
print("\\x1b]0;owned\\x07\\x1b[31mred output\\x1b[0m")
sys.exit(4)
"""


def command_job(name: str, argv: list[str], cwd: Path, extra: str = "") -> str:
    return (
        f'name = "{name}"\ntrainer = "command"\n[command]\nargv = {json.dumps(argv)}\ncwd = {json.dumps(str(cwd))}\n'
        f"{extra}\n[train]\nbatch_size = 1\nmax_steps = 1\n"
    )


def script(home: Path, owner: Any, name: str, text: str) -> Path:
    path = home / name
    path.write_text(text)
    subprocess.run(["chown", f"{owner.uid}:{owner.gid}", str(path)], check=True)
    return path


@pytest.fixture
def box(lab: Path, accounts) -> Iterator[tuple[Path, Daemon]]:
    """The lab with private homes (0700, as real ones are) and a root daemon running jobs as their owners."""
    for name in ("alice", "bob"):
        (lab / name).chmod(0o700)
    daemon = Daemon(lab / "state", "--max-parallel", "4").start()
    try:
        yield lab, daemon
    finally:
        if daemon.alive():
            daemon.stop(timeout=60)


def submit(who: Any, job: Path, state: Path) -> int:
    result = as_user(who.name, "submit", str(job), state=state, cwd=job.parent)
    assert result.returncode == 0 and "queued" in result.stdout, result.stdout + result.stderr
    return int(re.search(r"job (\d+)", result.stdout).group(1))


def readable_by(who: Any, folder: Path, secrets: list[str]) -> dict[str, list[str]]:
    """Every file under ``folder`` that ``who`` can open, with the secrets each holds."""
    code = textwrap.dedent(f"""
        import json, os, sys
        found = {{}}
        for top, folders, files in os.walk({str(folder)!r}):
            for name in files:
                path = os.path.join(top, name)
                try:
                    with open(path, "rb") as handle:
                        data = handle.read()
                except OSError:
                    continue
                hits = [s for s in {secrets!r} if s.encode() in data]
                found[path] = hits
        print(json.dumps(found))
    """)
    result = subprocess.run(["runuser", "-u", who.name, "--", sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(result.stdout)


def test_bob_never_reads_alices_env_values_or_webhook_secrets(box, accounts) -> None:
    lab, daemon = box
    alice, bob = accounts["alice"], accounts["bob"]
    state, home = lab / "state", lab / "alice"
    endpoint, dead = Endpoint(), dead_port()
    try:
        recorder = script(home, alice, "record.py", RECORDING)
        env = "[command.env]\n" + "".join(f"{name} = {json.dumps(value)}\n" for name, value in SECRETS.items()) + 'HF_HUB_OFFLINE = "1"\n'
        urls = [
            f"json://127.0.0.1:{endpoint.port}/{HOOK_SECRET}?token={QUERY_SECRET}",
            f"json://alice:{PASSWORD_SECRET}@127.0.0.1:{dead}/{DEAD_SECRET}",
        ]
        job = write_job(home, alice, "alice-secret", command_job(
            "alice-secret", [sys.executable, str(recorder), str(home / "seen.json"), *SECRETS], home,
            env + f"[notify]\nurls = {json.dumps(urls)}\n",
        ))
        job_id = submit(alice, job, state)
        record = daemon.wait_job(str(job_id), timeout=120)
        assert record["state"] == "finished", record
        # Her processes got the real values.
        assert json.loads((home / "seen.json").read_text()) == SECRETS
        # Her own server got the message, at its real path; the daemon tried the dead one and said so.
        wait_for(lambda: [path for path, _ in endpoint.received if path.startswith(f"/{HOOK_SECRET}")], 30, "alice's notification")
        wait_for(lambda: f"127.0.0.1:{dead}" in daemon.output() and "try 1 of" in daemon.output(), 30, "the failed delivery to be logged")

        # Bob: the record shows the names, never the values; the URLs only masked.
        for command in (["show", str(job_id), "--json"], ["show", str(job_id)], ["status", "--all"], ["show", "alice-secret", "--json"]):
            seen = as_user(bob.name, *command, state=state, cwd=lab / "bob")
            assert seen.returncode == 0, seen.stderr
            assert not [secret for secret in EVERY_SECRET if secret in seen.stdout + seen.stderr], (command, seen.stdout)
        shown = json.loads(as_user(bob.name, "show", str(job_id), "--json", state=state, cwd=lab / "bob").stdout)
        assert shown["spec"]["command"]["env"] == {**{name: "***" for name in SECRETS}, "HF_HUB_OFFLINE": "***"}
        assert shown["spec"]["notify"]["urls"][0].startswith(f"json://127.0.0.1:{endpoint.port}/****?")
        # Nothing bob can open under the lab (the store, its WAL, the spool, the workdir with
        # attempt.json and output.log, the daemon's log) holds one of alice's secrets.
        leaks = {path: hits for path, hits in readable_by(bob, lab, EVERY_SECRET).items() if hits}
        assert not leaks, leaks
        assert any(path.endswith("oomguard.db") for path in readable_by(bob, lab, []))  # he did read the store
        # Nor does the daemon's log, or the store as root reads it (only the secrets file has them).
        assert not [secret for secret in EVERY_SECRET if secret in daemon.output()], daemon.output()[-3000:]
        # The attempt's files in her workdir (her group may read them) hold the masked form.
        attempt_files = [path for path in Path(record["workdir"]).rglob("*") if path.is_file()]
        assert attempt_files and not [path for path in attempt_files if any(s.encode() in path.read_bytes() for s in EVERY_SECRET)]
        secrets_file = state / "secrets" / f"{job_id}.json"
        assert json.loads(secrets_file.read_text())["env"] == {**SECRETS, "HF_HUB_OFFLINE": "1"}
        # The dashboard (root's, reading everything) renders none of them, not even to alice.
        with serving(state) as dashboard:
            for who in (alice, bob):
                token = dashboard.sign_in(token_of(as_user(who.name, "web-url", state=state, cwd=lab / who.name.removeprefix("ogtest-")).stdout))
                for path in ("/", f"/jobs/{job_id}", f"/jobs/{job_id}?fragment=1", "/?page=1"):
                    page = dashboard.get(path, cookie=token)
                    assert page.status in (200, 403) and not [s for s in EVERY_SECRET if s in page.body], (who.name, path)
            alices = dashboard.sign_in(token_of(as_user(alice.name, "web-url", state=state, cwd=home).stdout))
            assert dashboard.get(f"/jobs/{job_id}", cookie=alices).status == 200

        # Alice still submits and cancels her own jobs; bob may not cancel hers.
        release = home / "release"
        waiting = write_job(home, alice, "alice-wait", command_job("alice-wait", [sys.executable, str(script(home, alice, "wait.py", WAITING)), str(release)], home, env))
        wait_id = submit(alice, waiting, state)
        wait_for(lambda: daemon.show(str(wait_id))["state"] == "running", 60, "alice's second job to run")
        refused = as_user(bob.name, "cancel", str(wait_id), state=state, cwd=lab / "bob")
        assert refused.returncode == 1 and "may not cancel" in refused.stderr, refused.stdout + refused.stderr
        cancelled = as_user(alice.name, "cancel", str(wait_id), state=state, cwd=home)
        assert cancelled.returncode == 0 and "cancel requested" in cancelled.stdout, cancelled.stdout + cancelled.stderr
        assert daemon.wait_job(str(wait_id), timeout=120)["state"] == "cancelled"
    finally:
        endpoint.close()


def test_alices_text_cannot_forge_a_log_line_or_reach_a_terminal_raw(box, accounts) -> None:
    lab, daemon = box
    alice, bob = accounts["alice"], accounts["bob"]
    state = lab / "state"
    endpoint = Endpoint()
    try:
        # Bob's job runs while alice's reports; his is the one her fake line names.
        release = lab / "bob" / "release"
        bob_job = write_job(lab / "bob", bob, "bob-victim", command_job(
            "bob-victim", [sys.executable, str(script(lab / "bob", bob, "wait.py", WAITING)), str(release)], lab / "bob",
        ))
        bob_id = submit(bob, bob_job, state)
        assert bob_id == 1
        wait_for(lambda: daemon.show(str(bob_id))["state"] == "running", 60, "bob's job to run")
        reporter = script(lab / "alice", alice, "report.py", REPORTING)
        evil = write_job(lab / "alice", alice, "alice-evil", command_job(
            "alice-evil", [sys.executable, str(reporter), "{workdir}", "{attempt}", EVIL_MESSAGE.replace("{", "{{").replace("}", "}}")], lab / "alice",
            f'[notify]\nurls = ["json://127.0.0.1:{endpoint.port}/alice"]\n',
        ))
        evil_id = submit(alice, evil, state)
        record = daemon.wait_job(str(evil_id), timeout=120)
        assert record["state"] == "failed" and "loss is nan" in record["result"], record

        # The daemon's log: her text is there, escaped, on the line of her own job's record.
        output = daemon.output()
        assert "loss is nan\\n[12:00:00] job 1 bob-victim" in output, output[-3000:]
        assert not UNSAFE.search(output), [line for line in output.splitlines() if UNSAFE.search(line)]
        assert "\u202e" not in output and "\x1b" not in output
        records = [line for line in output.splitlines() if re.match(r"\[\d\d:\d\d:\d\d\] job 1 bob-victim", line)]
        assert records and not [line for line in records if "cancelled" in line], records
        assert not [line for line in output.splitlines() if line.startswith(FAKE_RECORD)]
        # Every line is a record of its own or indented below one.
        assert all(line.startswith(("[", " ", "oomguard", "GPUs:", "notifier:")) for line in output.splitlines() if line), output

        # What bob (and root) see of her job: one line per item, nothing raw. `status` did not
        # fail on the console markup in her message.
        for who in (bob.name, "root"):
            for command in (["show", str(evil_id)], ["status", "--all"], ["show", str(evil_id), "--json"]):
                seen = as_user(who, *command, state=state, cwd=lab / "bob")
                assert seen.returncode == 0, (who, command, seen.stderr)
                assert not UNSAFE.search(seen.stdout + seen.stderr), (who, command, seen.stdout)
                assert not [line for line in seen.stdout.splitlines() if line.lstrip().startswith("[12:00:00]")], seen.stdout
        # Her output as root reads it: escaped; as she reads it: as her program wrote it.
        as_root_reads = oomguard("logs", str(evil_id), state_dir=state, check=True).stdout
        assert "red output" in as_root_reads and "\x1b" not in as_root_reads and "\\x1b[31m" in as_root_reads
        own = as_user(alice.name, "logs", str(evil_id), state=state, cwd=lab / "alice")
        assert own.returncode == 0 and "\x1b[31mred output" in own.stdout, own.stderr
        # Her notification: ten lines, one per field, nothing raw.
        body = wait_for(lambda: [b for path, b in endpoint.received if path == "/alice" and "failed" in b["title"]], 30, "alice's notification")[0]
        assert len(body["message"].split("\n")) == 10 and not UNSAFE.search(body["message"] + body["title"]), body
        # The report draws her "$\frac{$" as text.
        png = lab / "evil.png"
        assert oomguard("report", str(evil_id), "-o", str(png), state_dir=state).returncode == 0 and png.exists()

        # Bob's job was never cancelled by her text; he still cancels and submits his own.
        assert daemon.show(str(bob_id))["state"] == "running"
        cancelled = as_user(bob.name, "cancel", str(bob_id), state=state, cwd=lab / "bob")
        assert cancelled.returncode == 0 and "cancel requested" in cancelled.stdout, cancelled.stdout + cancelled.stderr
        assert daemon.wait_job(str(bob_id), timeout=120)["state"] == "cancelled"
        again = write_job(lab / "bob", bob, "bob-again", command_job("bob-again", [sys.executable, "-c", "pass"], lab / "bob"))
        assert daemon.wait_job(str(submit(bob, again, state)), timeout=120)["state"] == "finished"
    finally:
        release.touch()
        endpoint.close()
