"""User text made inert where it is printed (daemon/text.py), and a job's secrets kept to the
daemon (daemon/job_secrets.py): the units under tests/e2e/test_security_text.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomguard.daemon import cli
from oomguard.daemon.cli.daemon_cmd import InertOutput
from oomguard.daemon.cli.output import print_event
from oomguard.daemon.job_secrets import ENV_MASK, mask_env_value, public_spec, secrets_of, shows_secrets, with_env
from oomguard.daemon.notify_message import JobFacts, compose
from oomguard.daemon.paths import StateDir
from oomguard.daemon.report import load_report
from oomguard.daemon.report_plot import draw_report
from oomguard.daemon.store import Store
from oomguard.daemon.supervisor import Supervisor
from oomguard.daemon.text import escape, escape_block
from oomguard.jobs.command import render
from oomguard.jobs.spec import JobSpec, parse_job_text
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.errors import JobFileError
from tests.fakes import job_row

# What a user's outcome.json message did to the daemon's log and to `show` (issue 23, point 6).
FAKE_LINE = "loss is nan\n[12:00:00] job 2 bob-job: cancelled: cancelled by root\x1b[2K\x1b]0;owned\x07\r\u202etxt.exe [/bold]"
# Nothing that acts on a terminal or breaks a line: C0/C1 controls, DEL, bidi, separators.
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")


# escape -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain text, [brackets] and a \\ backslash", "plain text, [brackets] and a \\ backslash"),
        ("a\nb", "a\\nb"),
        ("a\r\nb\tc", "a\\r\\nb\\tc"),
        ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
        ("bell\x07 nul\x00 del\x7f csi\x9b", "bell\\x07 nul\\x00 del\\x7f csi\\x9b"),
        ("abc\u202edcba\u2066x\u2069", "abc\\u202edcba\\u2066x\\u2069"),
        ("line\u2028sep\x85", "line\\u2028sep\\x85"),
        ("lone \udc80 surrogate", "lone \\udc80 surrogate"),
        ("tag \U000e0041", "tag \\U000e0041"),
        ("accents é, 漢字 and 🙂 stay", "accents é, 漢字 and 🙂 stay"),
        (3, "3"),
    ],
)
def test_escape_shows_control_characters_as_escapes(text: Any, shown: str) -> None:
    assert escape(text) == shown


def test_escape_keeps_only_what_it_is_told_to() -> None:
    assert escape("a\nb\x1b\r", keep="\n") == "a\nb\\x1b\\r"
    assert escape("50%\r60%\n\tnext\x1b[K", keep="\n\r\t") == "50%\r60%\n\tnext\\x1b[K"


@given(st.text())
def test_escape_leaves_nothing_unsafe_and_is_idempotent(text: str) -> None:
    once = escape(text)
    assert not UNSAFE.search(once) and not re.search("[\ud800-\udfff]", once)
    assert escape(once) == once
    once.encode("utf-8")  # printable to any UTF-8 stream (a lone surrogate was not)


def test_escape_block_indents_every_line_after_the_first() -> None:
    block = escape_block(f"job 1 x: failed: {FAKE_LINE}", "Attempts:\n  1. [mb=8x1] diverged\x1b[31m\nfake\r")
    lines = block.split("\n")
    assert len(lines) == 4 and lines[0].startswith("job 1 x: failed: loss is nan\\n[12:00:00]")
    assert all(line.startswith("    ") for line in lines[1:])
    assert not UNSAFE.search(block.replace("\n", ""))


def test_print_event_indents_every_line_after_the_first(capsys) -> None:
    print_event(job_row(id=1, name="alice-job"), "failed", FAKE_LINE)
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert re.match(r"\[\d\d:\d\d:\d\d\] job 1 alice-job: failed: loss is nan$", lines[0])
    assert len(lines) == 2 and lines[1].startswith("    [12:00:00] job 2 bob-job: cancelled") and not UNSAFE.search(lines[1])


def test_the_daemons_output_lets_no_control_character_through_but_newlines() -> None:
    import io

    buffer = io.StringIO()
    out = InertOutput(buffer)
    print("rejected \u202eevil.toml: name \x1b[2J\x9b", file=out, flush=True)
    assert buffer.getvalue() == "rejected \\u202eevil.toml: name \\x1b[2J\\x9b\n"


def test_an_event_is_one_line_then_its_report(tmp_path: Path, capsys) -> None:
    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    supervisor = Supervisor(state, store, on_event=print_event)
    job_id = store.add_job(name="alice-job", owner="alice", spec={}, priority=0, workdir=None, plan=Plan.initial(8).to_dict(),
                           spool_file=None, jobs_root=state.jobs)
    supervisor.event(store.job(job_id), "failed", f"the loss diverged ({FAKE_LINE})", code="gave_up", report="Attempts:\n  1. [mb=8x1] diverged\x1b[31m")
    out = capsys.readouterr().out
    lines = out.rstrip("\n").split("\n")
    assert re.match(r"\[\d\d:\d\d:\d\d\] job 1 alice-job: failed: the loss diverged \(loss is nan\\n\[12:00:00\] job 2", lines[0])
    assert lines[1:] == ["    Attempts:", "      1. [mb=8x1] diverged\\x1b[31m"]
    assert not UNSAFE.search(out.replace("\n", ""))
    stored = store.events(job_id)[-1].message
    assert stored.split("\n")[0].endswith("[/bold])") and stored.count("\n") == 2  # the message one line, then the report's two
    store.close()


# notifications ------------------------------------------------------------------------------


def test_a_notification_has_one_line_per_field_whatever_the_summary() -> None:
    facts = JobFacts(
        job_id=1, job_name="alice-job", user="alice", event="failed", attempts=1, plan="mb=8x1", step=3, max_steps=10,
        peak_bytes=None, cap_bytes=None, summary=FAKE_LINE, next_step="look\x1b[2J",
    )
    title, body = compose(facts)
    lines = body.split("\n")
    assert len(lines) == 10 and lines[8].startswith("what happened: loss is nan\\n[12:00:00]")
    assert not UNSAFE.search(title + body.replace("\n", ""))


# outcome.json -------------------------------------------------------------------------------


def test_an_outcome_with_its_own_kind_step_or_phase_is_refused() -> None:
    good = Outcome(kind="crashed", step=3, message=FAKE_LINE).to_dict()
    assert Outcome.from_dict(good).message == FAKE_LINE  # the text itself is kept; it is escaped where shown
    for bad, error in [
        ({"kind": "oom\n[12:00:00] fake"}, ValueError),
        ({"kind": "cancelled by root"}, ValueError),
        ({"phase": "forward\x1b[2K"}, ValueError),
        ({"step": "3\nfake"}, TypeError),
        ({"step": None}, TypeError),
        ({"message": ["a", "b"]}, TypeError),
        ({"memory": {"breakdown": {"x": "y"}}}, TypeError),
        ({"memory": {"requested": "1 GiB"}}, TypeError),
        ({"recoveries": "not a list"}, TypeError),
        ({"memory": {"breakdown": {"activations\n[12:00:00] fake": 1}}}, TypeError),
        ({"plan": {**Plan.initial(8).to_dict(), "attention": "sliced\n[12:00:00] fake"}}, ValueError),
        ({"measurements": [{"plan": {"attention": "x\x1b[2J"}}]}, ValueError),
    ]:
        with pytest.raises(error):
            Outcome.from_dict({**good, **bad})
    with pytest.raises(TypeError):
        Outcome.from_dict(["not", "an", "object"])  # type: ignore[arg-type]


# secrets ------------------------------------------------------------------------------------

COMMAND_JOB = """\
name = "secret-job"
trainer = "command"
[command]
argv = ["python3", "train.py", "--bs={micro_batch}", "--ga={grad_accum}"]
[command.env]
HF_TOKEN = "hf_AliceSecret123"
WANDB_API_KEY = "wandb-secret-456"
CACHE = "{workdir}/cache"
BATCH_ENV = "{micro_batch}"
HF_HUB_OFFLINE = "1"
[notify]
urls = ["json://127.0.0.1:9/hook-SECRETPATH?token=QSECRET", "mailto://alice:pw-SECRET@example.com"]
[train]
batch_size = 8
max_steps = 4
"""
SECRETS = ("hf_AliceSecret123", "wandb-secret-456", "SECRETPATH", "QSECRET", "pw-SECRET")


def command_spec() -> JobSpec:
    return parse_job_text(COMMAND_JOB, "job.toml", base_dir=Path.cwd(), check_files=False)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("hf_abc", ENV_MASK), ("", ""), ("{workdir}/cache", "{workdir}" + ENV_MASK), ("{micro_batch}", "{micro_batch}"),
        ("a{workdir}b{attempt}", f"{ENV_MASK}{{workdir}}{ENV_MASK}{{attempt}}"), ("a{{b", ENV_MASK), ("{bad", ENV_MASK), (ENV_MASK, ENV_MASK),
    ],
)
def test_an_env_value_is_masked_but_its_placeholders(value: str, shown: str) -> None:
    assert mask_env_value(value) == shown


def test_the_public_spec_holds_no_secret_and_means_the_same_to_the_scheduler() -> None:
    spec = command_spec()
    full = spec.to_dict()
    public = public_spec(full)
    text = json.dumps(public)
    assert not [secret for secret in SECRETS if secret in text]
    assert public["command"]["env"] == {
        "BATCH_ENV": "{micro_batch}", "CACHE": "{workdir}***", "HF_HUB_OFFLINE": "***", "HF_TOKEN": "***", "WANDB_API_KEY": "***",
    }
    assert public["notify"]["urls"][0].startswith("json://127.0.0.1:9/****?")
    assert public_spec(public) == public and not shows_secrets(public) and shows_secrets(full)
    # The masked job is still a valid job with the same rungs and plan.
    stored = JobSpec.parse(json.loads(text))
    assert stored.policy() == spec.policy() and stored.initial_plan() == spec.initial_plan()
    # The secrets file holds what was masked; with it, the command gets its real environment.
    secrets = secrets_of(full)
    assert secrets == {"urls": list(spec.notify.urls), "env": dict(spec.command.env)}
    _, env = render(with_env(stored.command, secrets["env"]), Plan.initial(8), Path("/w"), 1)
    assert env == {"BATCH_ENV": "8", "CACHE": "/w/cache", "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_AliceSecret123", "WANDB_API_KEY": "wandb-secret-456"}


def test_errors_about_an_env_value_do_not_quote_it() -> None:
    for value in ('"hf_Sec{ret"', '"hf_Sec{micro_batch!r}ret"', "12345678"):
        text = COMMAND_JOB.replace('"hf_AliceSecret123"', value)
        with pytest.raises(JobFileError) as error:
            parse_job_text(text, "job.toml", base_dir=Path.cwd(), check_files=False)
        assert "command.env.HF_TOKEN" in str(error.value)
        assert "hf_Sec" not in str(error.value) and "12345678" not in str(error.value)


def test_the_daemon_stores_the_masked_form_and_keeps_the_values_to_itself(tmp_path: Path) -> None:
    from oomguard.daemon.users import Account

    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    supervisor = Supervisor(state, store)
    job_id = supervisor.add_job(command_spec(), Account.current())
    dumped = repr(store.jobs()) + repr(store.events(job_id))  # every column, the events' figures too
    assert not [secret for secret in SECRETS if secret in dumped]
    secrets_file = state.secrets / f"{job_id}.json"
    assert secrets_file.stat().st_mode & 0o777 == 0o600 and state.secrets.stat().st_mode & 0o077 == 0
    assert json.loads(secrets_file.read_text())["env"]["HF_TOKEN"] == "hf_AliceSecret123"
    assert supervisor._secret_urls(job_id) == command_spec().notify.urls
    store.close()


def test_a_store_of_an_older_oomguard_is_cleaned_when_the_daemon_starts(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    full = command_spec().to_dict()
    old = {**full, "notify": {**full["notify"], "urls": ["json://127.0.0.1:9/hook-SECRETPATH?method=POST"]}}  # as it was redacted
    ids = [
        store.add_job(name=f"old-{n}", owner="alice", spec=old, priority=0, workdir=None, plan=Plan.initial(8).to_dict(),
                      spool_file=None, jobs_root=state.jobs)
        for n in range(2)
    ]
    store.update_job(ids[1], state="finished")
    state.secrets.mkdir(mode=0o700)
    (state.secrets / f"{ids[0]}.json").write_text(json.dumps({"urls": full["notify"]["urls"]}))
    Supervisor(state, store)
    store.close()
    raw = b"".join(path.read_bytes() for path in state.root.iterdir() if path.name.startswith("oomguard.db"))
    assert not [secret for secret in SECRETS if secret.encode() in raw], "the database file still holds a secret"
    kept = json.loads((state.secrets / f"{ids[0]}.json").read_text())
    assert kept == {"urls": full["notify"]["urls"], "env": full["command"]["env"]}  # the real URLs, not the redacted ones
    assert not (state.secrets / f"{ids[1]}.json").exists()  # a finished job needs none


# the CLI ------------------------------------------------------------------------------------


def _stored_job(tmp_path: Path, **fields: Any) -> tuple[Path, int]:
    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    job_id = store.add_job(
        name="alice-job", owner="alice", owner_uid=os.geteuid() + 1, spec=public_spec(command_spec().to_dict()), priority=0,
        workdir=str(tmp_path / "work"), plan=Plan.initial(8).to_dict(), spool_file=None, jobs_root=state.jobs,
    )
    store.update_job(job_id, **fields)
    directory = tmp_path / "work" / "attempts" / "001"
    directory.mkdir(parents=True)
    outcome = Outcome(kind="diverged", step=2, message=FAKE_LINE, recoveries=({"step": "1\nfake", "reason": FAKE_LINE, "from": "x"},))
    store.add_attempt(
        job_id=job_id, number=1, plan=json.dumps(Plan.initial(8).to_dict()), directory=str(directory), started_at=1.0, ended_at=2.0,
        outcome_kind="diverged", outcome=json.dumps(outcome.to_dict()), reason=FAKE_LINE,
    )
    (directory / "output.log").write_text("epoch 1\r50%\x1b[31m red\x1b]0;title\x07\n")
    (directory / "heartbeat.json").write_text(json.dumps({"step": "x\x1b[2J", "samples_per_s": "fast", "peak_bytes": "big", "plan": "mb=8x1\x1b[2J\n[12:00:00] x"}))
    store.close()
    return state.root, job_id


def test_show_status_and_logs_print_a_users_text_inert(tmp_path: Path, capsys) -> None:
    from oomguard.strategies.doctor import report
    from oomguard.strategies.decision import PastAttempt
    from oomguard.strategies.policy import Policy

    # The doctor's report quotes what an attempt said, as one line each.
    quoted = report([PastAttempt(Plan.initial(8), Outcome.from_dict(Outcome(kind="diverged", message=FAKE_LINE).to_dict()))], Policy())
    root, job_id = _stored_job(tmp_path, state="running", result=FAKE_LINE, report=quoted)
    for command in (["show", str(job_id)], ["status"], ["logs", str(job_id)]):
        assert cli.main(["--state-dir", str(root), *command]) == 0, command
        out = capsys.readouterr().out
        assert not UNSAFE.search(out.replace("\n", "").replace("\r", "")), (command, out)
        assert not [line for line in out.splitlines() if "cancelled by root" in line and line.lstrip().startswith("[12:00:00]")], out
    # `logs` of someone else's job keeps its lines and carriage returns (progress bars), nothing else.
    assert cli.main(["--state-dir", str(root), "logs", str(job_id)]) == 0
    assert "epoch 1\r50%\\x1b[31m red\\x1b]0;title\\x07\n" in capsys.readouterr().out
    assert cli.main(["--state-dir", str(root), "show", str(job_id), "--json"]) == 0
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "hf_AliceSecret123" not in shown and '"HF_TOKEN": "***"' in shown


def test_status_survives_console_markup_in_a_result(tmp_path: Path, capsys) -> None:
    root, _ = _stored_job(tmp_path, state="failed", result="ValueError: [/bold] [link=http://x]y[/link] :smile:")
    assert cli.main(["--state-dir", str(root), "status"]) == 0
    assert "[/bold] [link=http://x]y[/link] :smile:" in capsys.readouterr().out.replace("\n", "")


def test_the_report_draws_a_users_text_as_text(tmp_path: Path) -> None:
    root, job_id = _stored_job(tmp_path, state="failed", result="ValueError: $\\frac{$ unbalanced \x1b[31m")
    store = Store(root / "oomguard.db")
    data = load_report(store.job(job_id), store.attempts(job_id), store.events(job_id))
    assert draw_report(data, tmp_path / "r.png").stat().st_size > 0  # a malformed formula made it raise
    store.close()
