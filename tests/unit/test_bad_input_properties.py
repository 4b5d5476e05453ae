"""Property tests: whatever a user writes, oomguard answers with a JobFileError (one line that
names the problem) or a valid job, never with another exception; a command's template keeps its
shape whatever the plan's values; and the spool survives any file dropped in the inbox.

Deterministic (``derandomize=True``): the same examples every run, so CI never flakes. Each
test runs at most a few hundred examples; the whole file takes well under 20 s on 2 cores.
The hand-picked cases live in tests/bad_jobs and tests/bad_inputs (tests/e2e/test_bad_inputs.py).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from oomguard.daemon.paths import StateDir
from oomguard.daemon.spool import REQUEST_SUFFIX, Spool, safe_name
from oomguard.daemon.store import Store
from oomguard.daemon.supervisor import Supervisor
from oomguard.jobs.command import render
from oomguard.jobs.spec import JobSpec, load_job_file, parse_job_text
from oomguard.jobs.spec.command import CommandSpec, check
from oomguard.jobs.spec.keys import PLACEHOLDERS, WHEN_KNOBS
from oomguard.strategies.plan import Plan
from oomguard.strategies.errors import CommandError, JobFileError
from tests.conftest import spooled_supervisor

FAST = settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

VALID_JOB: dict[str, Any] = {
    "name": "prop",
    "trainer": "unconditional",
    "data": {"source": "synthetic:16", "resolution": 16},
    "model": {
        "block_out_channels": [8, 16], "layers_per_block": 1, "norm_num_groups": 4,
        "down_block_types": ["DownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "UpBlock2D"],
    },
    "train": {"batch_size": 8, "max_steps": 4, "learning_rate": 1e-3},
    "ladder": {"allow": ["micro_batch"]},
}
VALID_COMMAND_JOB: dict[str, Any] = {
    "name": "prop-cmd",
    "trainer": "command",
    "command": {"argv": ["true", "--bs={micro_batch}", "--ga={grad_accum}"], "env": {"X": "1"}, "when": {"lora": ["--lora={lora_rank}"]}},
    "train": {"batch_size": 8, "max_steps": 4},
}


# ------------------------------------------------------------------------------ TOML, by hand


def toml_value(value: Any) -> str:
    """A value in TOML (inline form): enough of a writer for generated job files."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's escapes are TOML's (\\, \", \n, \uXXXX)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def to_toml(data: dict[str, Any]) -> str:
    """Top-level scalars first, then one [table] per top-level dict."""
    lines = [f"{json.dumps(str(k), ensure_ascii=False)} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for key, table in data.items():
        if isinstance(table, dict):
            lines.append(f"[{json.dumps(str(key), ensure_ascii=False)}]")
            lines += [f"{json.dumps(str(k), ensure_ascii=False)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ strategies

KNOWN_KEYS = [
    "name", "trainer", "priority", "workdir", "source", "resolution", "random_flip", "block_out_channels", "layers_per_block",
    "down_block_types", "up_block_types", "norm_num_groups", "batch_size", "max_steps", "learning_rate", "seed",
    "mixed_precision", "micro_batch", "allow", "max_attempts", "probe", "gpus", "share", "memory", "urls", "tags", "events",
    "argv", "cwd", "env", "when", "processes", "lora", "gradient_checkpointing",
]
odd_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from([
        "", " ", "\x00", "a\x00b", "~", "~nosuchuser/x", "~root", "..", "../../etc/passwd", "/nonexistent-oomguard", "/dev/null", "/proc/self/mem",
        "a" * 300, "a/" * 300, "synthetic:", "synthetic:-1", "synthetic:0x10", "synthetic:\u0661", "synthetic:99999999999999999999",
        "{micro_batch}", "{0}", "{}", "{micro_batch.__class__}", "{workdir!r}", "{micro_batch:>99999}", "$(rm -rf /)", "; rm -rf /",
        "`id`", "\u202e", "\ufeff", "nan", "1e999GiB", "-1GiB", "20GiB", "0B", "mailto://x:y@z", "json://", "\ud7ff",
    ]),
)
scalars = st.one_of(
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30, 4096, 4097]),
    st.floats(allow_nan=True, allow_infinity=True),
    odd_text,
    st.datetimes(),
    st.dates(),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
@st.composite
def mutated_jobs(draw: st.DrawFn) -> dict[str, Any]:
    """A valid job (built-in or command) with a few keys replaced, removed or added."""
    job = json.loads(json.dumps(draw(st.sampled_from([VALID_JOB, VALID_COMMAND_JOB]))))
    for _ in range(draw(st.integers(1, 4))):
        tables = [None] + [k for k, v in job.items() if isinstance(v, dict)] + ["resources", "notify", "ladder", "command"]
        table = draw(st.sampled_from(tables))
        target = job if table is None else job.setdefault(table, {}) if isinstance(job.get(table, {}), dict) else job
        key = draw(st.sampled_from(KNOWN_KEYS + list(target)) | st.text(max_size=8))
        action = draw(st.sampled_from(["set", "set", "set", "delete"]))
        if action == "delete":
            target.pop(key, None)
        else:
            target[key] = draw(values)
    return job


toml_fragments = st.one_of(
    st.sampled_from([
        "[train]", "[model]", "[data]", "[command]", "[command.env]", "[command.when]", "[[train]]", "[ladder]", "[resources]",
        'name = "x"', 'trainer = "command"', 'trainer = "unconditional"', 'argv = ["true", "{micro_batch}"]', "batch_size = 8",
        "max_steps = 4", "learning_rate = 1e-3", 'source = "synthetic:8"', "resolution = 16", "a.b.c = 1", "x = [[[[1]]]]",
        "x = {a = {b = {c = 1}}}", '"\\u0000" = 1', "x = 1979-05-27T07:32:00Z", "x = 0xDEADBEEF", "x = 1_000", "x = +inf",
        "x = '''\nmulti\n'''", "# comment", "", "=", "[", "]", "{", '"', "x = " + "9" * 5000, "x = " + "[" * 3000 + "]" * 3000,
    ]),
    st.builds(lambda k, v: f"{k} = {toml_value(v)}", st.sampled_from(KNOWN_KEYS), values),
    st.text(max_size=30),
)


# ------------------------------------------------------------------------------ job files


def refused_or_valid(call: Any) -> JobSpec | JobFileError:
    """Run ``call``; a JobFileError is returned (after checking its message), anything but a
    JobSpec or a JobFileError fails the test."""
    try:
        result = call()
    except JobFileError as error:
        message = str(error)
        assert error.problem.strip(), "a JobFileError without a problem"
        assert message.strip() and "Traceback" not in message
        assert not any(ord(c) < 32 or ord(c) == 127 for c in message), f"not one line: {message!r}"
        return error
    assert isinstance(result, JobSpec)
    return result


@FAST
@given(st.text(max_size=300))
@example("name = " + "[" * 5000 + "]" * 5000)
@example("x = " + "1" * 5000)
@example('name = "x"\ntrainer = "unconditional"\nworkdir = "~nosuchuser-oomguard/w"\n')
@example('name = "x"\ntrainer = "unconditional"\n[data]\nsource = "a\\u0000b"\nresolution = 8\n')
def test_any_text_is_a_job_or_a_job_file_error(text: str) -> None:
    refused_or_valid(lambda: parse_job_text(text, "job.toml", base_dir="/nonexistent-oomguard"))


@FAST
@given(st.lists(toml_fragments, max_size=14))
def test_toml_ish_text_is_a_job_or_a_job_file_error(lines: list[str]) -> None:
    refused_or_valid(lambda: parse_job_text("\n".join(lines), "job.toml", base_dir="/nonexistent-oomguard"))


@FAST
@given(mutated_jobs())
def test_a_mutated_job_is_a_job_or_one_line_naming_the_problem(job: dict[str, Any]) -> None:
    text = to_toml(job)
    outcome = refused_or_valid(lambda: parse_job_text(text, "job.toml", base_dir="/nonexistent-oomguard"))
    event("refused" if isinstance(outcome, JobFileError) else "valid")
    if isinstance(outcome, JobFileError):
        assert outcome.path == "job.toml" and str(outcome).startswith("job.toml: ")
    # The same dict through the store's path (no file system checks): the same kind of answer.
    refused_or_valid(lambda: JobSpec.parse(job))


@FAST
@given(st.dictionaries(st.text(max_size=10) | st.sampled_from(KNOWN_KEYS), values, max_size=8))
def test_any_dict_is_a_job_or_a_job_file_error(data: dict[str, Any]) -> None:
    refused_or_valid(lambda: JobSpec.parse(data))


@pytest.fixture(scope="module")
def job_file_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jobfiles")


@FAST
@given(st.binary(max_size=400) | st.text(max_size=200).map(lambda t: t.encode("utf-16")) | st.lists(toml_fragments, max_size=8).map(lambda lines: "\n".join(lines).encode()))
@example(b"\xff\xfe" + 'name = "x"'.encode("utf-16-le"))
@example(b"\x00" * 64)
@example(b"\xef\xbb\xbfname = 1")
def test_any_bytes_in_a_job_file_are_a_job_or_a_job_file_error(job_file_folder: Path, raw: bytes) -> None:
    path = job_file_folder / "job.toml"
    path.write_bytes(raw)
    refused_or_valid(lambda: load_job_file(path))


# ------------------------------------------------------------------------------ command templates

PLACEHOLDER_NAMES = sorted(PLACEHOLDERS)
template_piece = st.one_of(
    st.sampled_from([f"{{{name}}}" for name in PLACEHOLDER_NAMES]),
    st.sampled_from(["{", "}", "{{", "}}", "{0}", "{}", "{micro_batch.real}", "{micro_batch[0]}", "{workdir!r}", "{workdir!s}",
                     "{micro_batch:>9}", "{micro_batch:{workdir}}", "{lora_rank:d}", "{nope}", "!", ":", "$(id)", "`id`", ";", "|",
                     " ", "'", '"', "\\", "\n", "--x=", "*", "~"]),
    st.text(alphabet=string.ascii_letters + string.digits + "-_=./ ", max_size=8),
)
templates = st.lists(template_piece, max_size=5).map("".join).filter(bool)
plan_values = st.builds(
    lambda batch, world, micro_div, precision, attention, lora: Plan(
        batch_size=batch * world, micro_batch=max(1, batch // micro_div), world_size=world, mixed_precision=precision,
        attention=attention, lora_rank=lora,
    ),
    st.integers(1, 4096), st.integers(1, 8), st.integers(1, 64), st.sampled_from(["no", "bf16", "fp16"]),
    st.sampled_from(["default", "sliced"]), st.none() | st.integers(1, 512),
)
workdirs = st.text(max_size=30).map(lambda t: "/w/" + t) | st.sampled_from(["/w/{micro_batch}", "/w/$(rm -rf ~)", "/w/a b", "/w/{{x}}", "/w/'q'"])


@FAST
@given(
    st.lists(templates, min_size=1, max_size=6),
    st.dictionaries(st.sampled_from(sorted(WHEN_KNOBS)), st.lists(templates, min_size=1, max_size=3), max_size=3),
    st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,5}", fullmatch=True), templates, max_size=3),
    plan_values,
    workdirs,
    st.integers(1, 10**6),
)
def test_render_keeps_one_argument_per_template_argument(
    argv: list[str], when: dict[str, list[str]], env: dict[str, str], plan: Plan, workdir: str, attempt: int
) -> None:
    command = CommandSpec(argv=("prog", *argv), when=tuple(sorted((k, tuple(v)) for k, v in when.items())), env=tuple(sorted(env.items())))
    try:
        check(command)
    except CommandError as error:
        assert str(error).strip()
        event("refused by check()")
        return
    event("rendered")
    rendered, extra_env = render(command, plan, Path(workdir), attempt)
    on = [knob for knob, _ in command.when if _knob_on(plan, knob)]
    assert len(rendered) == len(command.argv) + sum(len(dict(command.when)[knob]) for knob in on)
    assert all(isinstance(a, str) for a in rendered) and set(extra_env) == set(env)
    for template, argument in zip(command.argv, rendered):
        if "{" not in template and "}" not in template:
            assert argument == template  # no quoting, no splitting, no shell
        if template == "{workdir}":
            assert argument == str(Path(workdir))  # braces and "$(...)" in the value stay as they are


def _knob_on(plan: Plan, knob: str) -> bool:
    from oomguard.jobs.command import knob_is_on

    return knob_is_on(plan, knob)


@FAST
@given(templates)
@example("{micro_batch:>99999999}")
@example("{workdir!r}")
@example("{micro_batch.__class__}")
@example("{0}")
def test_a_template_is_checked_or_refused_never_anything_else(template: str) -> None:
    try:
        check(CommandSpec(argv=("prog", template)))
    except CommandError as error:
        assert str(error).strip()
    else:
        # What check() lets through renders to exactly one argument, shorter than execve's limit.
        (argument,) = render(CommandSpec(argv=(template,)), Plan(batch_size=8, micro_batch=8), Path("/w"), 1)[0]
        assert len(argument) < 131072


# ------------------------------------------------------------------------------ the spool


file_names = st.one_of(
    st.binary(min_size=1, max_size=255),
    st.text(min_size=1, max_size=80).map(lambda t: os.fsencode(t) if _fs_ok(t) else b"x"),
    st.sampled_from([b"\xff\xfe.toml", b"a\nb.toml", b"L" * 255, b"x" * 250 + b".toml", b"..toml", b"a..b.request", b"-rf.toml",
                     b"$(id).toml", b"\xe2\x80\xaeevil.toml", b"job.toml.error", b"job.toml.2", b" .toml", b"\t.request"]),
).map(lambda raw: raw.replace(b"/", b"_").replace(b"\x00", b"_")).filter(lambda raw: raw not in (b".", b"..") and not raw.startswith(b"."))
contents = st.one_of(
    st.binary(max_size=300),
    st.lists(toml_fragments, max_size=8).map(lambda lines: "\n".join(lines).encode()),
    # No workdir: a valid job's workdir is created, and this test must not make folders elsewhere.
    st.builds(lambda job: to_toml({k: v for k, v in job.items() if k != "workdir"}).encode(), mutated_jobs()),
    st.sampled_from([
        b'{"action": "cancel", "job": "1"}', b'{"action": "cancel", "job": 99999999999999999999}', b'{"action": "cancel", "job": "\\u00b2"}',
        b'{"action": "cancel", "job": "\\ud800"}', b'{"action": ["cancel"], "job": 1}', b'{"action": "cancel", "job": true}',
        b"[" * 5000, b'{"action": "destroy", "job": "1"}', b"null", b"# oomguard-base-dir: ~nosuchuser\nname = 1\n",
        b"# oomguard-base-dir: rel\x00\nname = 1\n", b"# oomguard-base-dir: /tmp\n" + to_toml(VALID_JOB).encode(),
    ]),
)


def _fs_ok(text: str) -> bool:
    try:
        return 0 < len(os.fsencode(text)) <= 255
    except UnicodeEncodeError:
        return False


@pytest.fixture(scope="module")
def spool_box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StateDir, Store, Spool, Supervisor]]:
    with spooled_supervisor(tmp_path_factory.mktemp("spool")) as box:
        yield box


@FEW
@given(st.lists(st.tuples(file_names, contents), min_size=1, max_size=4))
def test_the_spool_answers_every_file_and_never_raises(spool_box: tuple[StateDir, Store, Spool, Supervisor], files: list[tuple[bytes, bytes]]) -> None:
    state, store, spool, supervisor = spool_box
    inbox = os.fsencode(state.inbox)
    for name, data in files:
        path = os.path.join(inbox, name)
        with open(path, "wb") as handle:
            handle.write(data)
        os.utime(path, (1, 1))  # settled: the rescan takes it at once
    supervisor.tick()
    # Every file left the inbox: accepted, answered (a request) or rejected with its reason.
    assert os.listdir(inbox) == []
    for entry in os.listdir(os.fsencode(state.rejected)):
        name = os.fsdecode(entry)
        if not name.endswith(".error"):
            error = Path(state.rejected, name + ".error").read_text(encoding="utf-8")
            assert error.strip() and "Traceback" not in error
    for folder in (state.rejected, state.accepted):
        for entry in os.listdir(os.fsencode(folder)):
            os.unlink(os.path.join(os.fsencode(folder), entry))


@FAST
@given(file_names.map(os.fsdecode))
def test_a_safe_name_is_short_printable_utf8_and_keeps_the_suffix(name: str) -> None:
    renamed = safe_name(name)
    if renamed is None:
        assert name.isprintable() and len(name.encode("utf-8")) <= 200
        return
    assert renamed.isprintable() and len(renamed.encode("utf-8")) <= 200 and not renamed.startswith(".")
    assert "/" not in renamed and "\x00" not in renamed
    for suffix in (REQUEST_SUFFIX, ".toml"):
        assert renamed.endswith(suffix) == name.endswith(suffix)
