"""The commands about one job in the daemon's queue: `cancel` (through the spool, answered by
the daemon in the store), `show`, `logs` and `report` (`submit`: daemon/cli/submit.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from oomguard.daemon.cli.log_print import AttemptLog
from oomguard.daemon.cli.output import EXIT_FAILED, EXIT_OK, CliError, say, short_plan
from oomguard.daemon.cli.state import answer_to, current_user, find_job, job_record, open_store, write_spool_file
from oomguard.daemon.inbox import request_text
from oomguard.daemon.store import TERMINAL_STATES
from oomguard.daemon.text import escape
from oomguard.jobs.attempt import LOG
from oomguard.strategies.errors import ReportError


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancelling goes through the spool like submitting: the daemon checks who asks (the
    owner of the request file) against who owns the job, and answers in the store."""
    state, store = open_store(args.state_dir)
    job = find_job(store, args.job)
    if job.state in TERMINAL_STATES:
        raise CliError(f"job {job.id} ({job.name}) has already ended: {job.state}", EXIT_FAILED)
    spooled = write_spool_file(state.inbox, f"cancel-{job.id}", request_text("cancel", str(job.id)), suffix=".request")
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        _, answer = answer_to(store, spooled)
        if answer is not None:
            if answer.job_id not in (None, job.id):
                raise CliError(
                    f"the daemon answered your request {spooled.name} about job {answer.job_id}, not job {job.id}: "
                    "it is not your answer; run `oomguard cancel` again", EXIT_FAILED,
                )
            if not answer.accepted:
                raise CliError(f"refused: {answer.answer}", EXIT_FAILED)
            say(answer.answer)
            return EXIT_OK
        time.sleep(0.1)
    print(f"cancel request for job {job.id} is in the spool; the daemon applies it when it runs (`oomguard daemon`)")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    _, store = open_store(args.state_dir)
    job = find_job(store, args.job)
    record = job_record(store, job)
    if args.json:
        print(json.dumps(record, indent=2))
        return EXIT_OK
    # Every line is one line of the record, escaped (text.escape): results, reasons and what an
    # attempt died of quote what its runner wrote, which its owner may fill with anything.
    say(f"job {record['id']} {record['name']} (owner {record['owner']}): {record['state']}")
    say(f"  workdir: {record['workdir']}")
    command = record["spec"].get("command")
    if command:
        say(f"  runs in: {command.get('cwd') or record['workdir']}")
    say(f"  plan: {short_plan(record['plan'])}")
    if job.state == "queued" and job.disk_path is not None:
        from oomguard.daemon.disk_wait import disk_note

        say(f"  {disk_note(job)}")
    if record["result"]:
        say(f"  result: {record['result']}")
    for attempt in record["attempts"]:
        outcome = attempt["outcome"] or {}
        where = f" (Slurm job {attempt['scheduler_id']})" if attempt.get("scheduler_id") else ""
        say(f"  attempt {attempt['number']}{where}: [{short_plan(attempt['plan'])}] {_how_it_ended(outcome)}")
        if attempt["rung"] or attempt["reason"]:
            say(f"    why: {attempt['rung'] or 'retry'}: {attempt['reason']}")
        _print_runner_record(outcome)
    if record["report"]:
        print(escape(record["report"], keep="\n"))
    return EXIT_OK


def _how_it_ended(outcome: dict[str, Any]) -> str:
    """An attempt's end for `show`: how and at which step, and what a failed one died of."""
    from oomguard.strategies.outcome import SUMMED_UP_KINDS, Outcome

    if not outcome:
        return "running"
    ended = f"{outcome.get('kind')} at step {outcome.get('step')}"
    if outcome.get("kind") in SUMMED_UP_KINDS:
        try:
            summary = Outcome.from_dict(outcome).summary
        except (TypeError, ValueError, AttributeError):  # stored by an oomguard that took any outcome.json
            summary = str(outcome.get("message") or "").strip().partition("\n")[0]
        ended += f": {summary}" if summary else ""
    return ended


def _print_runner_record(outcome: dict[str, Any]) -> None:
    """What the runner did on its own: rungs it took (probe, in-process) and what it measured."""
    from oomguard.strategies.units import format_bytes

    for change in outcome.get("recoveries") or []:
        if not isinstance(change, dict):
            continue
        why = f"{change['oom']}; {change.get('reason')}" if isinstance(change.get("oom"), str) else change.get("reason")
        say(f"    step {change.get('step')}, in the runner: [{short_plan(change.get('from'))}] -> [{short_plan(change.get('to'))}]: {why}")
    for measured in outcome.get("measurements") or []:
        peak, capacity = format_bytes(measured["peak_bytes"]), format_bytes(measured.get("capacity"))
        what = f"peak {peak} of {capacity}" if measured["fits"] else f"out of memory (needed more than {peak} of {capacity})"
        speed = f", {measured['samples_per_s']:.1f} samples/s" if measured.get("samples_per_s") else ""
        say(f"    measured [{short_plan(measured['plan'])}]: {what}{speed}")


def cmd_logs(args: argparse.Namespace) -> int:
    _, store = open_store(args.state_dir)
    job = find_job(store, args.job)
    # The owner sees their own output as their program wrote it (colours, progress bars, as
    # `cat` would show it); anyone else (root, an admin) sees it escaped but for its newlines,
    # carriage returns and tabs: a job's output must not act on the terminal of whoever reads it.
    own = job.owner_uid == os.geteuid() if job.owner_uid is not None else job.owner == current_user()

    def write(text: str) -> None:
        sys.stdout.write(text if own else escape(text, keep="\n\r\t"))
        sys.stdout.flush()

    # Per attempt: its log, printed from where the last look stopped (daemon/cli/log_print.py:
    # the head, how much was dropped, the tail files, across their renames).
    logs: dict[str, AttemptLog] = {}
    try:
        while True:
            for attempt in store.attempts(job.id):
                directory = attempt.directory
                if directory not in logs:
                    print(f"== attempt {attempt.number} ({short_plan(attempt.plan_dict())}) ==", flush=True)
                    logs[directory] = AttemptLog(Path(directory), write)
                try:
                    logs[directory].print_new()
                except BrokenPipeError:
                    raise  # the reader went away (`oomguard logs 1 | head`): the CLI ends quietly
                except PermissionError:
                    raise CliError(f"cannot read {Path(directory) / LOG}: it belongs to {job.owner}, whose job it is; ask them, or run it as root", EXIT_FAILED) from None
                except OSError as error:
                    raise CliError(f"cannot read {error.filename or Path(directory) / LOG}: {error.strerror or error} (a log is read only as a regular file, never through a link)", EXIT_FAILED) from None
            if not args.follow or store.job(job.id).state in TERMINAL_STATES:
                return EXIT_OK
            time.sleep(0.5)
    finally:
        for log in logs.values():
            log.close()


def cmd_report(args: argparse.Namespace) -> int:
    from oomguard.daemon.report import load_report
    from oomguard.daemon.report_plot import draw_report

    _, store = open_store(args.state_dir)
    job = find_job(store, args.job)
    out = Path(args.output) if args.output else Path(f"oomguard-job-{job.id}.png")
    try:
        written = draw_report(load_report(job, store.attempts(job.id), store.events(job.id)), out)
    except ReportError as error:
        raise CliError(str(error), EXIT_FAILED) from None
    except OSError as error:
        raise CliError(f"cannot write {out}: {error.strerror}; choose another --output") from None
    print(f"wrote {written}")
    return EXIT_OK
