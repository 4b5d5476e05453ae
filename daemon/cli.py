"""The `oomguard` command line. It never imports torch: every command starts in well under a
second, and only the runner processes it starts load the training stack.

Exit codes: 0 success; 1 the job failed or was cancelled (`run`), or the request was refused;
2 bad usage or invalid input (a bad job file or size); 3 no such job; 4 the state directory is
held by another daemon; 130 interrupted (Ctrl-C); 141 the reader of its output went away
(`oomguard logs 1 | head`).
"""

from __future__ import annotations

import argparse
import codecs
import fcntl
import json
import os
import pwd
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from oomguard.daemon.paths import StateDir, default_state_dir
from oomguard.daemon.store import TERMINAL_STATES, JobNotFound, Store, owns
from oomguard.daemon.text import escape, escape_block
from oomguard.daemon.users import user_name
from oomguard.jobs.attempt import HEARTBEAT, LOG, read_json
from oomguard.jobs.sizes import EMULATE_DEVICE_MEMORY_ENV, CapSchedule
from oomguard.jobs.spec import JobFileError, load_job_file

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_LOCKED = 4
EXIT_INTERRUPTED = 130
# The reader of standard output went away (`oomguard logs 1 | head`): 128 + SIGPIPE, what a shell
# reports for any program the closed pipe stopped (cat, grep), so a pipeline reads the same
# with oomguard in it; 0 would claim every line was delivered.
EXIT_READER_GONE = 141


class CliError(Exception):
    """A problem the user can fix; printed without a traceback."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def current_user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def print_event(job: dict[str, Any], kind: str, message: str) -> None:
    """One record of the daemon's log: the event's first line, then any further lines (a
    report) indented below it, all escaped (text.escape_block): nothing a user wrote can start
    a line that reads as a record of its own, or act on the terminal of whoever reads it."""
    stamp = time.strftime("%H:%M:%S")
    first, _, rest = str(message).partition("\n")
    print(f"[{stamp}] " + escape_block(f"job {job['id']} {job['name']}: {kind}: {first}", rest), flush=True)


def stdout_to_devnull() -> None:
    """Point standard output at /dev/null once its reader has gone: what is still buffered is
    dropped there instead of failing again at exit with a traceback (Python's own recipe, "Note
    on SIGPIPE" in the signal module's documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def print_table(table: Any) -> None:
    """A rich table on standard output, whole rows when piped (not cut to 80 columns)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError  # ended as by any other command (main), not by rich's exit(1)

    # No console markup or emoji codes: a cell holds a user's text ("[/bold]" in a message
    # made rich raise, and `status` fail for everyone); the cells are escaped (text.escape).
    _Console(width=None if sys.stdout.isatty() else 240, markup=False, emoji=False).print(table)


def cap_schedule(text: str | None) -> str | None:
    """Validate an --emulate-device-memory value; returns its canonical text."""
    if text is None:
        return None
    try:
        return str(CapSchedule.parse(text))
    except ValueError as error:
        raise CliError(f"--emulate-device-memory: {error}") from None


def open_store(state_dir: Path) -> tuple[StateDir, Store]:
    """The state directory and its store: read-only for a user who may read a system daemon's
    store but not write it (the daemon owns it; users talk to it through the spool)."""
    state = StateDir(state_dir)
    if state.database.exists() and not os.access(state.database, os.W_OK):
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
    from oomguard.daemon.spool import job_key_problem
    from oomguard.daemon.store import AmbiguousJobName

    problem = job_key_problem(key)
    if problem:
        raise JobNotFound(problem)
    uid = os.geteuid()
    try:
        return store.job_for(key, uid, user_name(uid))
    except AmbiguousJobName as error:
        raise CliError(str(error)) from None


def write_spool_file(inbox: Path, stem: str, text: str, suffix: str = ".toml") -> Path:
    """A new file in the inbox under a fresh unguessable name (spool.write_to_inbox)."""
    from oomguard.daemon.spool import InboxNameTaken, write_to_inbox

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


def answer_to(store: Store, spooled: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """What the daemon recorded for the inbox file ``spooled`` that this process wrote: (the job
    it queued, the answer to it), both None while there is none. Only a record for this user
    counts: the CLI never reports anyone else's answer as its own (a record under its name for
    another user means the name was taken; it is not its answer)."""
    uid = os.geteuid()
    me = user_name(uid)
    job = store.job_by_spool_file(spooled.name)
    if job is not None:
        if owns(job, uid, me):
            return job, None
        raise CliError(
            f"the daemon recorded the name of your file {spooled.name} for job {job['id']} of {job['owner']}, not for you: "
            "that is not your job, and yours was not queued; submit it again (it gets a new name)", EXIT_FAILED,
        )
    answer = store.request_by_file(spooled.name)
    if answer is not None:
        if answer["requester"] == me:
            return None, answer
        raise CliError(
            f"the daemon recorded the name of your file {spooled.name} for a file of {answer['requester']}, not for you: "
            "its answer is not yours, and yours was not answered; run the command again (it gets a new name)", EXIT_FAILED,
        )
    return None, None


def latest_heartbeat(store: Store, job_id: int) -> dict[str, Any] | None:
    attempts = store.attempts(job_id)
    return heartbeat_of(attempts[-1] if attempts else None)


def heartbeat_of(attempt: dict[str, Any] | None) -> dict[str, Any] | None:
    """An attempt's heartbeat; None also when it is another user's to read (a job's workdir
    belongs to its owner): read_json says None for every file it cannot read, and when it is
    not a JSON object (the job's owner writes it: anything)."""
    heartbeat = read_json(Path(attempt["directory"]) / HEARTBEAT) if attempt else None
    return heartbeat if isinstance(heartbeat, dict) else None


def job_record(store: Store, job: dict[str, Any]) -> dict[str, Any]:
    """A job with its attempts and events, as `show --json` and `run --json` print it."""
    record = {**job, "spec": json.loads(job["spec"]), "plan": json.loads(job["plan"])}
    record["cancel_requested"] = bool(job["cancel_requested"])
    record["attempts"] = [
        {
            **attempt,
            "plan": json.loads(attempt["plan"]),
            "outcome": json.loads(attempt["outcome"]) if attempt["outcome"] else None,
        }
        for attempt in store.attempts(job["id"])
    ]
    record["events"] = store.events(job["id"])
    record["heartbeat"] = latest_heartbeat(store, job["id"])
    return record


# Commands ---------------------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    from oomguard.daemon.spool import spool_text

    path = Path(args.file)
    try:
        submit_dir = Path.cwd()
    except FileNotFoundError:
        raise CliError("the folder you are in was removed; cd to an existing folder and submit again") from None
    try:
        spec = load_job_file(path, submit_dir)
    except JobFileError as error:
        raise CliError(f"rejected: {error}") from None
    state, store = open_store(args.state_dir)
    spooled = write_spool_file(state.inbox, path.stem, spool_text(path, submit_dir))
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        job, answer = answer_to(store, spooled)
        if job is not None:
            print(f"job {job['id']} ({job['name']}) queued")
            return EXIT_OK
        if answer is not None:  # the daemon refused it (e.g. a priority above the cap)
            raise CliError(f"refused: {answer['answer']}", EXIT_FAILED)
        time.sleep(0.1)
    print(f"{spec.name} is in the spool ({spooled}); the daemon queues it when it runs (`oomguard daemon`)")
    return EXIT_OK


# What `status` lists without --all: every job that runs (or is about to), the head of the
# queue, and the jobs that ended last. A queue of 10,000 jobs is then one screen (under a
# second) rather than 10,000 rows (18 s); the counts of all jobs come first.
STATUS_QUEUED_SHOWN = 20
STATUS_ENDED_SHOWN = 10


def status_rows(jobs: list[dict[str, Any]], queue: list[dict[str, Any]], everything: bool) -> list[dict[str, Any]]:
    """The jobs `status` lists, in id order: all of them, or the running and otherwise active
    ones, the first STATUS_QUEUED_SHOWN of ``queue`` (the queued jobs in the order they will
    run, Store.queued_jobs) and the STATUS_ENDED_SHOWN that ended last."""
    if everything:
        return jobs
    ended = sorted((j for j in jobs if j["state"] in TERMINAL_STATES), key=lambda j: j["ended_at"] or 0)
    active = [j for j in jobs if j["state"] != "queued" and j["state"] not in TERMINAL_STATES]
    chosen = {j["id"] for j in (*active, *queue[:STATUS_QUEUED_SHOWN], *ended[-STATUS_ENDED_SHOWN:])}
    return [j for j in jobs if j["id"] in chosen]


def cmd_status(args: argparse.Namespace) -> int:
    from collections import Counter

    from rich.table import Table

    from oomguard.strategies.outcome import format_bytes

    _, store = open_store(args.state_dir)
    jobs = store.jobs()
    rows = status_rows(jobs, store.queued_jobs(), args.all)
    newest = store.newest_attempts([job["id"] for job in rows])
    counts = Counter(job["state"] for job in jobs)
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no jobs"
    table = Table(title=f"oomguard jobs ({args.state_dir}): {summary}")
    for column in ("job", "name", "user", "state", "GPUs", "plan", "step", "samples/s", "ETA", "peak / cap", "attempts", "note"):
        table.add_column(column, overflow="fold")
    for job in rows:
        attempt = newest.get(job["id"])
        running = job["state"] == "running"
        heartbeat = heartbeat_of(attempt) or {}
        spec = json.loads(job["spec"])
        plan = json.loads(job["plan"])
        max_steps = spec["train"]["max_steps"]
        step = _number(heartbeat.get("step")) or 0
        speed = _number(heartbeat.get("samples_per_s")) if running else None
        eta = ""
        if speed and speed > 0:
            steps_left = max_steps - step
            eta = _duration(steps_left * spec["train"]["batch_size"] / speed)
        memory = ""
        if _number(heartbeat.get("peak_bytes")) is not None and job["state"] not in TERMINAL_STATES:
            memory = f"{format_bytes(int(heartbeat['peak_bytes']))} / {format_bytes(_int_or_none(heartbeat.get('capacity_bytes')))}"
        gpus = attempt["gpus"] if running and attempt and attempt["gpus"] else ""
        if job["state"] == "queued" and job["waiting"]:
            note = f"waiting: {job['waiting']}"
        elif job["cancel_requested"] and job["state"] not in TERMINAL_STATES:
            note = "cancel requested"
        else:
            note = (job["result"] or "").splitlines()[0] if job["result"] else ""
        cells = (
            str(job["id"]), job["name"], job["owner"], job["state"], gpus, _short_plan(plan), f"{step}/{max_steps}",
            f"{speed:.1f}" if speed else "", eta, memory, str(attempt["count"] if attempt else 0), note,
        )
        table.add_row(*(escape(cell) for cell in cells))
    if len(rows) < len(jobs):
        table.caption = (
            f"{len(rows)} of {len(jobs)} jobs shown: those running, the next {STATUS_QUEUED_SHOWN} queued and the "
            f"last {STATUS_ENDED_SHOWN} ended; `oomguard status --all` lists every job"
        )
    print_table(table)
    return EXIT_OK


def _number(value: Any) -> int | float | None:
    """A number from a file a job's owner writes (heartbeat.json), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf"):
        return value
    return None


def _int_or_none(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None else None


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def cmd_gpus(args: argparse.Namespace) -> int:
    """The GPUs as the daemon's monitor last sampled them, with the jobs on each."""
    from rich.table import Table

    from oomguard.strategies.outcome import format_bytes

    _, store = open_store(args.state_dir)
    samples = store.latest_gpu_samples()
    if not samples:
        raise CliError("no GPU samples yet: the daemon records them when it runs with GPUs (NVML) or --emulate-gpus", EXIT_FAILED)
    jobs_on: dict[int, list[str]] = {}
    for attempt in store.running_attempts():
        if attempt["gpus"]:
            job = store.job(attempt["job_id"])
            for index in attempt["gpus"].split(","):
                jobs_on.setdefault(int(index), []).append(f"{job['id']} {job['name']} ({job['owner']})")
    table = Table(title=f"GPUs (sampled {time.strftime('%H:%M:%S', time.localtime(max(s['at'] for s in samples)))})")
    for column in ("GPU", "name", "used", "free", "total", "processes", "oomguard jobs"):
        table.add_column(column, overflow="fold")
    for sample in samples:
        processes = json.loads(sample["processes"] or "[]")
        listed = ", ".join(f"{p['pid']}: {format_bytes(p['used'])}" for p in processes)
        cells = (
            str(sample["gpu"]), sample["name"] or "", format_bytes(sample["used"]), format_bytes(max(sample["total"] - sample["used"], 0)),
            format_bytes(sample["total"]), listed, "; ".join(jobs_on.get(sample["gpu"], [])),
        )
        table.add_row(*(escape(cell) for cell in cells))
    print_table(table)
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from oomguard.daemon.report import ReportError, draw_report, load_report

    _, store = open_store(args.state_dir)
    job = find_job(store, args.job)
    out = Path(args.output) if args.output else Path(f"oomguard-job-{job['id']}.png")
    try:
        written = draw_report(load_report(job, store.attempts(job["id"]), store.events(job["id"])), out)
    except ReportError as error:
        raise CliError(str(error), EXIT_FAILED) from None
    except OSError as error:
        raise CliError(f"cannot write {out}: {error.strerror}; choose another --output") from None
    print(f"wrote {written}")
    return EXIT_OK


def cmd_neighbour(args: argparse.Namespace) -> int:
    """An emulated neighbour: a process that holds memory on an emulated GPU for a while."""
    from oomguard.jobs.emulated_gpus import EmulatedGpuFolder
    from oomguard.jobs.sizes import format_size, parse_size

    state = StateDir(args.state_dir)
    folder = EmulatedGpuFolder(state.emulated_gpus)
    try:
        gpu = folder.gpu(args.gpu)
        steps = [parse_size(part) for part in args.take.split(",")]
    except FileNotFoundError as error:
        raise CliError(str(error)) from None
    except ValueError as error:
        raise CliError(f"{error}; `oomguard gpus` lists the GPUs") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    pid = os.getpid()
    try:
        # Each size is held for --seconds, in turn: "10MiB,40MiB" grows from 10 to 40 MiB.
        for size in steps:
            folder.publish(gpu.index, pid, size, "neighbour")
            print(f"neighbour {pid} holds {format_size(size)} on emulated GPU {gpu.index}", flush=True)
            if stop.wait(args.seconds):
                break
    finally:
        folder.withdraw(gpu.index, pid)
    print(f"neighbour {pid} released GPU {gpu.index}", flush=True)
    return EXIT_OK


def _short_plan(plan: Any) -> str:
    """Plan.short() of a plan dict; '?' for what is no plan (a runner's record may hold anything)."""
    from oomguard.strategies.plan import Plan

    try:
        return Plan.from_dict(plan).short()
    except (TypeError, ValueError, AttributeError):
        return "?"


def cmd_show(args: argparse.Namespace) -> int:
    _, store = open_store(args.state_dir)
    record = job_record(store, find_job(store, args.job))
    if args.json:
        print(json.dumps(record, indent=2))
        return EXIT_OK
    # Every line is one line of the record, escaped (text.escape): results, reasons and what an
    # attempt died of quote what its runner wrote, which its owner may fill with anything.
    _say(f"job {record['id']} {record['name']} (owner {record['owner']}): {record['state']}")
    _say(f"  workdir: {record['workdir']}")
    command = record["spec"].get("command")
    if command:
        _say(f"  runs in: {command.get('cwd') or record['workdir']}")
    _say(f"  plan: {_short_plan(record['plan'])}")
    if record["result"]:
        _say(f"  result: {record['result']}")
    for attempt in record["attempts"]:
        outcome = attempt["outcome"] or {}
        _say(f"  attempt {attempt['number']}: [{_short_plan(attempt['plan'])}] {_how_it_ended(outcome)}")
        if attempt["rung"] or attempt["reason"]:
            _say(f"    why: {attempt['rung'] or 'retry'}: {attempt['reason']}")
        _print_runner_record(outcome)
    if record["report"]:
        print(escape(record["report"], keep="\n"))
    return EXIT_OK


def _say(line: str) -> None:
    """Print one line of output that may quote a user's text, escaped: one line, inert."""
    print(escape(line))


def _how_it_ended(outcome: dict[str, Any]) -> str:
    """An attempt's end for `show`: how and at which step, and what a failed one died of."""
    from oomguard.strategies.outcome import Outcome

    if not outcome:
        return "running"
    ended = f"{outcome.get('kind')} at step {outcome.get('step')}"
    if outcome.get("kind") in ("crashed", "host_oom", "diverged"):
        try:
            summary = Outcome.from_dict(outcome).summary
        except (TypeError, ValueError, AttributeError):  # stored by an oomguard that took any outcome.json
            summary = str(outcome.get("message") or "").strip().partition("\n")[0]
        ended += f": {summary}" if summary else ""
    return ended


def _print_runner_record(outcome: dict[str, Any]) -> None:
    """What the runner did on its own: rungs it took (probe, in-process) and what it measured."""
    from oomguard.strategies.outcome import format_bytes

    for change in outcome.get("recoveries") or []:
        if not isinstance(change, dict):
            continue
        why = f"{change['oom']}; {change.get('reason')}" if isinstance(change.get("oom"), str) else change.get("reason")
        _say(f"    step {change.get('step')}, in the runner: [{_short_plan(change.get('from'))}] -> [{_short_plan(change.get('to'))}]: {why}")
    for measured in outcome.get("measurements") or []:
        peak, capacity = format_bytes(measured["peak_bytes"]), format_bytes(measured.get("capacity"))
        what = f"peak {peak} of {capacity}" if measured["fits"] else f"out of memory (needed more than {peak} of {capacity})"
        speed = f", {measured['samples_per_s']:.1f} samples/s" if measured.get("samples_per_s") else ""
        _say(f"    measured [{_short_plan(measured['plan'])}]: {what}{speed}")


def cmd_logs(args: argparse.Namespace) -> int:
    _, store = open_store(args.state_dir)
    job = find_job(store, args.job)
    # Per attempt log: how much of it is printed, and a decoder that keeps a character split
    # between two reads whole.
    printed: dict[str, tuple[int, codecs.IncrementalDecoder]] = {}
    # The owner sees their own output as their program wrote it (colours, progress bars, as
    # `cat` would show it); anyone else (root, an admin) sees it escaped but for its newlines,
    # carriage returns and tabs: a job's output must not act on the terminal of whoever reads it.
    own = job["owner_uid"] == os.geteuid() if job["owner_uid"] is not None else job["owner"] == current_user()
    while True:
        for attempt in store.attempts(job["id"]):
            directory = attempt["directory"]
            if directory not in printed:
                print(f"== attempt {attempt['number']} ({_short_plan(json.loads(attempt['plan']))}) ==", flush=True)
                printed[directory] = (0, codecs.getincrementaldecoder("utf-8")(errors="replace"))
            offset, decoder = printed[directory]
            try:
                printed[directory] = (_print_log_from(Path(directory) / LOG, offset, decoder, raw=own), decoder)
            except PermissionError:
                raise CliError(f"cannot read {Path(directory) / LOG}: it belongs to {job['owner']}, whose job it is; ask them, or run it as root", EXIT_FAILED) from None
        if not args.follow or store.job(job["id"])["state"] in TERMINAL_STATES:
            return EXIT_OK
        time.sleep(0.5)


# `logs` copies a log a block at a time: a log of gigabytes is never held in memory, and a
# reader that went away is noticed at the next block.
LOG_BLOCK_BYTES = 1 << 16


def _print_log_from(log: Path, offset: int, decoder: codecs.IncrementalDecoder, *, raw: bool = True) -> int:
    """Print ``log`` from byte ``offset`` to its current end; returns the new end. Not ``raw``:
    escaped but for newlines, carriage returns and tabs (text.escape)."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            for block in iter(lambda: f.read(LOG_BLOCK_BYTES), b""):
                text = decoder.decode(block)
                sys.stdout.write(text if raw else escape(text, keep="\n\r\t"))
                sys.stdout.flush()
                offset += len(block)
    except FileNotFoundError:
        pass  # the attempt has not started writing yet
    return offset


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancelling goes through the spool like submitting: the daemon checks who asks (the
    owner of the request file) against who owns the job, and answers in the store."""
    from oomguard.daemon.spool import request_text

    state, store = open_store(args.state_dir)
    job = find_job(store, args.job)
    if job["state"] in TERMINAL_STATES:
        raise CliError(f"job {job['id']} ({job['name']}) has already ended: {job['state']}", EXIT_FAILED)
    spooled = write_spool_file(state.inbox, f"cancel-{job['id']}", request_text("cancel", str(job["id"])), suffix=".request")
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        _, answer = answer_to(store, spooled)
        if answer is not None:
            if answer["job_id"] not in (None, job["id"]):
                raise CliError(
                    f"the daemon answered your request {spooled.name} about job {answer['job_id']}, not job {job['id']}: "
                    "it is not your answer; run `oomguard cancel` again", EXIT_FAILED,
                )
            if not answer["accepted"]:
                raise CliError(f"refused: {answer['answer']}", EXIT_FAILED)
            _say(answer["answer"])
            return EXIT_OK
        time.sleep(0.1)
    print(f"cancel request for job {job['id']} is in the spool; the daemon applies it when it runs (`oomguard daemon`)")
    return EXIT_OK


# What oomguard does about each verdict of `diagnose`.
DIAGNOSE_ACTIONS = {
    "oom_fragmentation": "takes the allocator rung (expandable_segments:True, in a fresh process), so that PyTorch can use "
    "the reserved memory it holds in pieces; then the rest of the ladder if that is not enough",
    "oom_other_process": "waits for the other processes' memory to come back and retries the same plan, when its GPU "
    "figures show a neighbour grew while the job did not (contention); otherwise it takes the ladder as for any OOM",
    "oom": "takes the cheapest allowed rung of the ladder that fits (micro-batch, checkpointing, ...) and resumes from the "
    "last checkpoint",
    "host_oom": "nothing on the ladder: host RAM ran out, not the GPU; it retries the attempt as a crash (fewer data-loader "
    "workers or less host-side caching, or more RAM, is the fix)",
    "not_oom": "nothing on the ladder: this is not an out-of-memory error; it retries the same plan (ladder.crash_retries) "
    "and then gives up with a report; the same error at the same step twice ends the job at once",
}


def cmd_diagnose(args: argparse.Namespace) -> int:
    from oomguard.strategies.oom_text import describe_size, read_oom, read_oom_log

    if args.logfile == "-":
        verdict = read_oom(sys.stdin.read())
    else:
        path = Path(args.logfile)
        if path.is_dir():
            raise CliError(f"{path}: is a directory; give the log file itself, e.g. {path / 'attempts' / '001' / LOG}")
        try:
            verdict = read_oom_log(path)
        except FileNotFoundError:
            raise CliError(f"{path}: no such file; give the path of a training log, or - to read standard input") from None
        except OSError as error:
            raise CliError(f"{path}: cannot read it ({error.strerror}); check its permissions") from None
    if args.json:
        print(json.dumps(verdict.to_dict(), indent=2))
        return EXIT_OK
    words = {
        "oom": "out of device memory",
        "oom_fragmentation": "out of device memory: fragmentation",
        "oom_other_process": "out of device memory: other processes hold it",
        "host_oom": "out of host memory (RAM)",
        "not_oom": "not an out-of-memory error",
    }
    where = ""
    if verdict.is_device_oom and verdict.device:
        where = f" ({verdict.device}" + (f":{verdict.gpu_index})" if verdict.gpu_index is not None else ")")
    print(f"verdict: {words[verdict.kind]}{where}")
    _say(f"why: {verdict.reason}")
    sizes = [
        ("requested", verdict.requested),
        ("device total", verdict.total),
        ("free on the device", verdict.free),
        ("allowed (per-process limit)", verdict.allowed),
        ("allocated by PyTorch", verdict.allocated),
        ("  of which in private pools", verdict.private_pools),
        ("reserved but unallocated", verdict.reserved_unallocated),
        ("this process in use", verdict.process_in_use),
        *((f"process {pid} in use", used) for pid, used in verdict.other_processes.items()),
    ]
    known = [(label, n) for label, n in sizes if n is not None]
    if known:
        print("sizes:")
        for label, n in known:
            print(f"  {label:<30} {describe_size(n):>12}")
    if verdict.message:
        _say(f"error: {verdict.message}")
    print(f"oomguard: {DIAGNOSE_ACTIONS[verdict.kind]}")
    return EXIT_OK


class _Lock:
    """One daemon per state directory: an flock on STATE/daemon.lock."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            raise CliError(f"another oomguard daemon (pid {holder}) is using {path.parent}; stop it first", EXIT_LOCKED) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(str(os.getpid()))
        self.file.flush()


def _stop_on_signals(supervisor: Any, *, stop_jobs: bool = True) -> None:
    """SIGTERM/SIGINT: checkpoint and stop running attempts (``stop_jobs``), or leave them
    running for the next daemon to adopt."""

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if stop_jobs:
            if not supervisor.stopping:
                print(f"received {name}: checkpointing and stopping running attempts", flush=True)
            supervisor.stop_all()
        else:
            print(f"received {name}: leaving running attempts running; the next daemon adopts them", flush=True)
            supervisor.leave_all()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


class _InertOutput:
    """The daemon's standard output (its log), with every control character but the newline
    escaped (text.escape) whatever printed it: the last guard of the log against a user's text
    that some message quotes (a name in a refusal, an error's text). Where a line ends is
    decided where a record is made (print_event, Supervisor.event)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(escape(text, keep="\n"))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, ...
        return getattr(self.stream, name)


def cmd_daemon(args: argparse.Namespace) -> int:
    plain = sys.stdout
    sys.stdout = _InertOutput(plain)
    try:
        return _daemon(args)
    finally:
        sys.stdout = plain


def _daemon(args: argparse.Namespace) -> int:
    from oomguard.daemon.gpus import NoGpus, open_gpus
    from oomguard.daemon.monitor import GpuMonitor
    from oomguard.daemon.notifier import Notifier
    from oomguard.daemon.sd_notify import SystemdNotifier
    from oomguard.daemon.spool import DEFAULT_MAX_USER_PRIORITY, Spool
    from oomguard.daemon.supervisor import Supervisor
    from oomguard.daemon.users import InsecureStateDir, secure_state_dir, system_mode

    if args.max_parallel is not None and args.max_parallel < 1:
        raise CliError(f"--max-parallel must be at least 1, got {args.max_parallel}")
    max_user_priority = DEFAULT_MAX_USER_PRIORITY if args.max_user_priority is None else args.max_user_priority
    if not -(2**63) <= max_user_priority <= 2**63 - 1:
        raise CliError(f"--max-user-priority must fit a 64-bit integer (a job's priority does), got {max_user_priority}")
    state = create_state_dir(args.state_dir)
    state.secrets.mkdir(mode=0o700, exist_ok=True)
    lock = _Lock(state.root / "daemon.lock")
    try:
        # Before the store is opened: closing any descriptor of the database file would drop
        # this process's SQLite locks (POSIX record locks belong to the process, not the fd).
        secure_state_dir(
            state.root, state.inbox, [state.accepted, state.rejected, state.secrets],
            [state.database, Path(f"{state.database}-wal"), Path(f"{state.database}-shm")],
        )
    except InsecureStateDir as error:
        raise CliError(f"{error}; fix the state directory or choose another --state-dir") from None
    store = Store(state.database)
    try:
        monitor: GpuMonitor | None = GpuMonitor(open_gpus(args.emulate_gpus, state.emulated_gpus), store, every_seconds=args.gpu_sample_seconds)
    except ValueError as error:
        raise CliError(f"--emulate-gpus: {error}") from None
    except NoGpus as error:
        print(f"oomguard: {error}", flush=True)
        monitor = None
    config_paths = [Path(p) for p in args.notify_config] if args.notify_config else None
    notifier = Notifier(config_paths, throttle_seconds=args.notify_throttle)
    spool = Spool(state.inbox, state.accepted, state.rejected)
    supervisor = Supervisor(
        state, store, max_parallel=args.max_parallel, emulate_device_memory=cap_schedule(args.emulate_device_memory), on_event=print_event,
        spool=spool, gpus=monitor, notifier=notifier, admin_group=args.admin_group, stall_seconds=args.stall_after,
        max_user_priority=max_user_priority,
    )
    _stop_on_signals(supervisor, stop_jobs=args.stop_jobs)
    spool.start()
    systemd = SystemdNotifier()
    mode = "system mode: jobs run as their owners" if system_mode() else f"user mode: jobs run as {current_user()}"
    stopping_said = False
    try:  # from here on, whatever ends the daemon (a reader of its output gone too) goes through finally
        if monitor is not None:
            print(f"GPUs: {monitor.source.description}", flush=True)
        print(f"oomguard daemon {os.getpid()} watching {state.inbox} ({mode})", flush=True)
        systemd.ready(f"watching {state.inbox}")
        while not supervisor.stopped():
            supervisor.tick()
            systemd.tick()
            if supervisor.stopping and not stopping_said:
                # Attempts are checkpointing: systemd waits for them (TimeoutStopSec).
                systemd.stopping()
                stopping_said = True
            time.sleep(args.poll_interval)
    finally:
        if not stopping_said:
            systemd.stopping()
        spool.stop()
        # Messages already queued get a moment to go out; retries do not hold the daemon up.
        notifier.flush(timeout=5.0)
        notifier.close()
        store.close()
        lock.file.close()
    print("oomguard daemon stopped", flush=True)
    return EXIT_OK


def progress_line(heartbeat: dict[str, Any]) -> str:
    """A heartbeat in one line; a command job's script may not show its loss, and its first step
    in a process has no speed yet."""
    from oomguard.strategies.outcome import format_bytes

    parts = [f"step {heartbeat.get('step')}/{heartbeat.get('max_steps')}"]
    if isinstance(heartbeat.get("loss"), (int, float)):
        parts.append(f"loss {heartbeat['loss']:.4f}")
    if isinstance(heartbeat.get("samples_per_s"), (int, float)):
        parts.append(f"{heartbeat['samples_per_s']:.1f} samples/s")
    if isinstance(heartbeat.get("peak_bytes"), int):
        parts.append(f"peak {format_bytes(heartbeat['peak_bytes'])}")
    return "  ".join(parts)


def cmd_run(args: argparse.Namespace) -> int:
    from oomguard.daemon.supervisor import Supervisor
    from oomguard.daemon.users import Account

    try:
        spec = load_job_file(Path(args.file))
    except JobFileError as error:
        raise CliError(f"rejected: {error}") from None
    emulate = cap_schedule(args.emulate_device_memory)
    workdir = Path(args.workdir).resolve()
    if (workdir / "final").exists():
        raise CliError(f"{workdir} already holds a finished run ({workdir / 'final'}); choose another --workdir or remove it")
    state, store = open_store(workdir / ".oomguard")
    lock = _Lock(state.root / "daemon.lock")
    quiet = args.json
    supervisor = Supervisor(state, store, emulate_device_memory=emulate, on_event=None if quiet else print_event)
    unfinished = [j for j in store.jobs() if j["name"] == spec.name and j["state"] not in TERMINAL_STATES]
    if unfinished:
        job_id = unfinished[-1]["id"]
        if not quiet:
            print(f"continuing job {job_id} ({spec.name}) in {workdir}", flush=True)
    else:
        job_id = supervisor.add_job(spec, Account.current(), workdir=str(workdir))
    _stop_on_signals(supervisor)
    last_progress, last_step = 0.0, None
    while True:
        supervisor.tick()
        if supervisor.job_done(job_id) or (supervisor.stopping and not supervisor.active()):
            break
        if not quiet and time.monotonic() - last_progress >= 5:
            heartbeat = latest_heartbeat(store, job_id)
            if heartbeat and heartbeat.get("step") != last_step and store.job(job_id)["state"] == "running":
                last_step = heartbeat.get("step")
                print(f"    {progress_line(heartbeat)}", flush=True)
            last_progress = time.monotonic()
        time.sleep(0.2)
    job = store.job(job_id)
    if args.json:
        print(json.dumps(job_record(store, job), indent=2))
    store.close()
    lock.file.close()
    if supervisor.stopping and job["state"] not in TERMINAL_STATES:
        if not quiet:
            print(f"stopped; run the same command again to continue from the checkpoint in {workdir}", flush=True)
        return EXIT_INTERRUPTED
    return EXIT_OK if job["state"] == "finished" else EXIT_FAILED


# Parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oomguard", description="Keeps diffusion training jobs alive through GPU out-of-memory errors.")
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="the daemon's state directory (default: $OOMGUARD_STATE_DIR or ~/.local/state/oomguard)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    daemon = commands.add_parser("daemon", help="run the supervisor in the foreground")
    daemon.add_argument(
        "--max-parallel", type=int, default=None,
        help="attempts running at once, at most (default: as many as the GPUs take; 1 without GPUs)",
    )
    daemon.add_argument(
        "--emulate-gpus", metavar="GPUS", default=None,
        help="emulated GPUs instead of NVML, e.g. 2x64MiB or 64MiB,48MiB (`oomguard neighbour` takes memory on them)",
    )
    daemon.add_argument("--admin-group", metavar="GROUP", default=None, help="members of GROUP may cancel anyone's job (system mode)")
    daemon.add_argument(
        "--max-user-priority", type=int, default=None, metavar="N",
        help="the highest priority a job may have unless its owner is root, the daemon's own user or in --admin-group (default 100)",
    )
    daemon.add_argument(
        "--notify-config", metavar="FILE", action="append", default=None,
        help="an apprise configuration file (repeatable; default: apprise's own, e.g. ~/.config/apprise/apprise.yml, /etc/apprise.yml)",
    )
    daemon.add_argument("--notify-throttle", type=float, default=600.0, metavar="SECONDS", help="the same message for the same job at most once per SECONDS (default 600)")
    daemon.add_argument(
        "--stall-after", type=float, default=1800.0, metavar="SECONDS", help="report an attempt as stalled after SECONDS without a heartbeat, and a job that waited that long for a GPU (default 1800)"
    )
    daemon.add_argument("--gpu-sample-seconds", type=float, default=5.0, help=argparse.SUPPRESS)
    daemon.add_argument(
        "--emulate-device-memory", metavar="SIZE", default=os.environ.get(EMULATE_DEVICE_MEMORY_ENV),
        help=f"emulated device capacity, e.g. 48MiB or 64MiB,40MiB@15 (default: ${EMULATE_DEVICE_MEMORY_ENV})",
    )
    daemon.add_argument(
        "--stop-jobs", action="store_true",
        help="on SIGTERM/Ctrl-C, checkpoint and stop running attempts and requeue them (default: leave them running for the next daemon)",
    )
    daemon.add_argument("--poll-interval", type=float, default=0.5, help=argparse.SUPPRESS)
    daemon.set_defaults(handler=cmd_daemon)

    submit = commands.add_parser("submit", help="validate a job file and queue it")
    submit.add_argument("file")
    submit.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the daemon to queue it (default 10)")
    submit.set_defaults(handler=cmd_submit)

    status = commands.add_parser(
        "status",
        help=f"a table of the jobs: those running, the next {STATUS_QUEUED_SHOWN} queued and the last {STATUS_ENDED_SHOWN} ended (--all: every job)",
    )
    status.add_argument("--all", action="store_true", help="list every job, however many")
    status.set_defaults(handler=cmd_status)
    commands.add_parser("gpus", help="the GPUs, what is on them, and which jobs").set_defaults(handler=cmd_gpus)

    report = commands.add_parser("report", help="a PNG of a job's memory over time per attempt, OOMs, rungs and samples/s")
    report.add_argument("job", help="job id or name")
    report.add_argument("-o", "--output", metavar="PNG", help="where to write it (default: oomguard-job-ID.png here)")
    report.set_defaults(handler=cmd_report)

    neighbour = commands.add_parser("neighbour", help="hold memory on an emulated GPU for a while (to try contention)")
    neighbour.add_argument("--gpu", type=int, default=0, help="the emulated GPU (default 0)")
    neighbour.add_argument("--take", required=True, metavar="SIZES", help="memory to hold, e.g. 40MiB; 10MiB,40MiB holds each in turn")
    neighbour.add_argument("--seconds", type=float, default=10.0, help="how long to hold each size (default 10)")
    neighbour.set_defaults(handler=cmd_neighbour)

    show = commands.add_parser("show", help="one job with its attempts, plans and outcomes")
    show.add_argument("job", help="job id or name")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=cmd_show)

    logs = commands.add_parser("logs", help="the training output of a job's attempts")
    logs.add_argument("job", help="job id or name")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    logs.set_defaults(handler=cmd_logs)

    cancel = commands.add_parser("cancel", help="checkpoint and stop a job (yours, or any if you are root or an admin)")
    cancel.add_argument("job", help="job id or name")
    cancel.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the daemon's answer (default 10)")
    cancel.set_defaults(handler=cmd_cancel)

    diagnose = commands.add_parser("diagnose", help="read a training log: did it run out of memory, which memory, and why")
    diagnose.add_argument("logfile", metavar="LOGFILE", help="a log file (its last error decides), or - for standard input")
    diagnose.add_argument("--json", action="store_true", help="print the verdict as a JSON object")
    diagnose.set_defaults(handler=cmd_diagnose)

    run = commands.add_parser("run", help="run one job in the foreground (no daemon needed)")
    run.add_argument("file")
    run.add_argument("--workdir", required=True, help="where checkpoints, attempts and the final model go")
    run.add_argument(
        "--emulate-device-memory", metavar="SIZE", default=os.environ.get(EMULATE_DEVICE_MEMORY_ENV),
        help=f"emulated device capacity, e.g. 48MiB or 64MiB,40MiB@15 (default: ${EMULATE_DEVICE_MEMORY_ENV})",
    )
    run.add_argument("--json", action="store_true", help="print only the final job record as JSON")
    run.set_defaults(handler=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _run_command(argv)
    except BrokenPipeError:
        # The reader of its output went away (`oomguard logs 1 | head`): end quietly, as a
        # program stopped by SIGPIPE does, instead of with a traceback. `daemon` and `run` too:
        # their attempts run in sessions of their own and are adopted by the next daemon (or
        # `run` of the same job), as after any other stop; and the supervisor's own error
        # handling prints, so a broken pipe inside its loop ends up here, never against a job.
        stdout_to_devnull()
        return EXIT_READER_GONE


def _run_command(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        # --help (or a usage error) ends here; its text is flushed while a reader gone is
        # still a BrokenPipeError main() handles, not lost at the interpreter's exit.
        sys.stdout.flush()
        raise
    if args.state_dir is None:
        args.state_dir = default_state_dir()
    try:
        code = int(args.handler(args))
        # Written out here, where a reader gone is still an error main() handles, rather than
        # at the interpreter's exit.
        sys.stdout.flush()
        return code
    except CliError as error:
        # A message may quote a job file, a job's answer or a name: escaped, its own lines kept.
        print(f"oomguard: {escape(error, keep=chr(10))}", file=sys.stderr)
        return error.code
    except JobNotFound as error:
        print(f"oomguard: {escape(error)}", file=sys.stderr)
        return EXIT_NOT_FOUND


if __name__ == "__main__":
    sys.exit(main())
