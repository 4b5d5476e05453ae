"""The daemon's state as the CLI reaches it: the state directory and its store (read-only for a
user who may not write a system daemon's), the job a user names, the inbox files it writes
and the daemon's answers to them, and a job's record as `show --json` and `run --json` print it."""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

from oomguard.daemon.cli.output import EXIT_FAILED, CliError
from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store, owns
from oomguard.daemon.store_rows import AttemptRow, JobRow, RequestRow
from oomguard.daemon.users import user_name
from oomguard.jobs.attempt import HEARTBEAT, AttemptFiles
from oomguard.jobs.device import DeviceSpec
from oomguard.jobs.emulated_allocator import AllocatorEmulation
from oomguard.jobs.sizes import CapSchedule
from oomguard.strategies.errors import AmbiguousJobName, InboxNameTaken, JobNotFound

# How an attempt's folder is opened to read what its processes wrote.
FilesOf = Callable[[AttemptRow], AttemptFiles]


def current_user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def device_from_option(text: str | None, allocator: str | None = None) -> DeviceSpec:
    """The device an --emulate-device-memory value asks for (None: the real one) and how it
    allocates (--emulate-allocator), parsed once; a value that is neither is the user's error."""
    try:
        emulated_allocator = AllocatorEmulation.parse(allocator) if allocator is not None else None
    except ValueError as error:
        raise CliError(f"--emulate-allocator: {error}") from None
    if text is None:
        return DeviceSpec(allocator=emulated_allocator)
    try:
        return DeviceSpec(CapSchedule.parse(text), emulated_allocator)  # "" too is a value, and not a schedule
    except ValueError as error:
        raise CliError(f"--emulate-device-memory: {error}") from None


def open_store(state_dir: Path, *, snapshot: bool = False) -> tuple[StateDir, Store]:
    """The state directory and its store: read-only for a user who may read a system daemon's
    store but not write it (the daemon owns it; users talk to it through the spool), and for a
    ``snapshot``: a command that reads once what is there now (`status`) needs neither the
    schema check nor sqlite-utils, which a store opened for writing loads (~70 ms)."""
    state = StateDir(state_dir)
    if state.database.exists() and (snapshot or not os.access(state.database, os.W_OK)):
        return state, Store(state.database, readonly=True)
    return create_state_dir(state_dir), Store(state.database)


def create_state_dir(state_dir: Path) -> StateDir:
    # Any OSError, not only PermissionError: a --state-dir that is a file (NotADirectoryError)
    # ended `status`, `submit` and `daemon` with a traceback.
    try:
        return StateDir(state_dir).create()
    except OSError as error:
        raise CliError(f"cannot use the state directory {state_dir} ({error.strerror or error}); is --state-dir right?") from None


def find_job(store: Store, key: str) -> dict[str, Any]:
    """The job a user names on the command line (an id or a name). A name means the user's own
    job of that name first, else the one job of anyone else that has it; a name several jobs
    share that way is refused (exit 2) with their ids (Store.job_for). A key of digits that is
    no possible id ("99999999999999999999", or "\u00b2", a digit to str.isdigit) is "no such job"
    (exit 3), not the OverflowError or ValueError the store raised for it."""

    from oomguard.daemon.inbox import job_key_problem

    problem = job_key_problem(key)
    if problem:
        raise JobNotFound(problem)
    uid = os.geteuid()
    try:
        return store.job_for(key, uid, user_name(uid))
    except AmbiguousJobName as error:
        raise CliError(str(error)) from None


def write_spool_file(inbox: Path, stem: str, text: str, suffix: str = ".toml") -> Path:
    """A new file in the inbox under a fresh unguessable name (inbox.write_to_inbox)."""
    from oomguard.daemon.inbox import write_to_inbox

    try:
        return write_to_inbox(inbox, stem, text, suffix)
    except InboxNameTaken as error:
        raise CliError(
            f"cannot place a file in the inbox {inbox}: {error.strerror}, which only someone making files there on "
            "purpose can do; try again, and tell the administrator if it happens again", EXIT_FAILED,
        ) from None
    except OSError as error:
        raise CliError(
            f"cannot write into the inbox {inbox} ({error.strerror or error}); is --state-dir (or $OOMGUARD_STATE_DIR) the "
            "daemon's state directory, and has the daemon set it up (it makes the inbox writable for everyone when it starts)?"
        ) from None


@dataclass(frozen=True)
class Answer:
    """What the daemon recorded for an inbox file that this process wrote."""

    job: JobRow | None = None  # the job it queued
    request: RequestRow | None = None  # its answer to a request, or its refusal of a job file
    problem: str | None = None  # the file's name holds another user's record: no answer to it


def answers_to(store: Store, spooled: list[Path]) -> dict[Path, Answer]:
    """What the daemon recorded for each inbox file in ``spooled`` that this process wrote
    (files without a record yet are left out), in two queries however many. Only a record for
    this user counts: the CLI never reports anyone else's answer as its own (a record under its
    name for another user means the name was taken; it is not its answer)."""
    uid = os.geteuid()
    me = user_name(uid)
    names = [path.name for path in spooled]
    jobs = store.jobs_by_spool_files(names)
    requests = store.requests_by_files([name for name in names if name not in jobs])
    answers: dict[Path, Answer] = {}
    for path in spooled:
        job, request = jobs.get(path.name), requests.get(path.name)
        if job is not None:
            answers[path] = Answer(job=job) if owns(job, uid, me) else Answer(problem=(
                f"the daemon recorded the name of your file {path.name} for job {job.id} of {job.owner}, not for you: "
                "that is not your job, and yours was not queued; submit it again (it gets a new name)"
            ))
        elif request is not None:
            answers[path] = Answer(request=request) if request.requester == me else Answer(problem=(
                f"the daemon recorded the name of your file {path.name} for a file of {request.requester}, not for you: "
                "its answer is not yours, and yours was not answered; run the command again (it gets a new name)"
            ))
    return answers


def answer_to(store: Store, spooled: Path) -> tuple[JobRow | None, RequestRow | None]:
    """What the daemon recorded for one inbox file this process wrote (answers_to): (the job it
    queued, the answer to it), both None while there is none; a record of another user's under
    its name is refused (CliError)."""
    answer = answers_to(store, [spooled]).get(spooled, Answer())
    if answer.problem is not None:
        raise CliError(answer.problem, EXIT_FAILED)
    return answer.job, answer.request


def latest_heartbeat(store: Store, job_id: int, files_of: FilesOf | None = None) -> dict[str, Any] | None:
    attempts = store.attempts(job_id)
    return heartbeat_of(attempts[-1] if attempts else None, files_of)


def heartbeat_of(attempt: AttemptRow | None, files_of: FilesOf | None = None) -> dict[str, Any] | None:
    """An attempt's heartbeat; None also when it is another user's to read (a job's workdir
    belongs to its owner): read_json says None for every file it cannot read, and when it is
    not a JSON object (the job's owner writes it: anything). ``files_of``: how the attempt's
    folder is opened (as named by default, for the CLI's own user; the dashboard, as root,
    opens it as its owner's without following a link: daemon/attempts.py files_of)."""
    if attempt is None:
        return None
    with (files_of or _as_named)(attempt) as files:
        heartbeat = files.read_json(HEARTBEAT)
    return heartbeat if isinstance(heartbeat, dict) else None


def _as_named(attempt: AttemptRow) -> AttemptFiles:
    return AttemptFiles(Path(attempt.directory))


def jobs_on_gpus(store: Store, attempts: list[AttemptRow]) -> dict[int, list[str]]:
    """GPU index -> "3 alice-a (alice)" for each job whose running attempt (of ``attempts``) is
    on it: what `oomguard gpus` and the dashboard's GPU page list."""
    jobs_on: dict[int, list[str]] = {}
    for attempt in attempts:
        job = store.job(attempt.job_id)
        for index in attempt.gpus or ():
            jobs_on.setdefault(index, []).append(f"{job.id} {job.name} ({job.owner})")
    return jobs_on


def job_record(store: Store, job: JobRow, files_of: FilesOf | None = None) -> dict[str, Any]:
    """A job with its attempts and events, as `show --json` and `run --json` print it: the rows
    as stored, their JSON columns as objects."""
    record = {**job.as_stored(), "spec": job.spec_dict(), "plan": job.plan_dict()}
    record["cancel_requested"] = job.cancel_requested
    record["attempts"] = [
        {**attempt.as_stored(), "plan": attempt.plan_dict(), "outcome": attempt.outcome_dict()}
        for attempt in store.attempts(job.id)
    ]
    # Each event with its code and figures (null and {} for one recorded before they were
    # kept): what a program matches on, where the message is for people.
    record["events"] = [{**event.as_stored(), "data": event.data} for event in store.events(job.id)]
    record["heartbeat"] = latest_heartbeat(store, job.id, files_of)
    return record
