"""`oomguard submit FILE...`: validate job files and queue them through the spool.

Every file is checked before any is placed in the inbox: a batch with a bad file is refused
whole, each problem named, so that nothing is half-submitted. Then each goes into the inbox
(daemon/inbox.py) and the command waits for the daemon's answers, asking the store after all
the files at once (state.answers_to): a thousand files are queued in seconds, not one CLI
start per file."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from oomguard.daemon.cli.output import EXIT_FAILED, EXIT_OK, CliError
from oomguard.daemon.cli.state import Answer, answers_to, open_store, write_spool_file
from oomguard.daemon.text import escape

if TYPE_CHECKING:
    from oomguard.daemon.store import Store

# How often the store is asked for the daemon's answers while some are missing.
ASK_EVERY_SECONDS = 0.1


def cmd_submit(args: argparse.Namespace) -> int:
    from oomguard.daemon.inbox import spool_text
    from oomguard.jobs.spec import load_job_file
    from oomguard.strategies.errors import JobFileError

    try:
        submit_dir = Path.cwd()
    except FileNotFoundError:
        raise CliError("the folder you are in was removed; cd to an existing folder and submit again") from None
    paths = [Path(file) for file in args.files]
    names: dict[Path, str] = {}
    problems: list[str] = []
    for path in paths:
        try:
            names[path] = load_job_file(path, submit_dir).name
        except JobFileError as error:
            problems.append(f"rejected: {error}")
    if problems:
        more = f"; none of the {len(paths)} files was submitted: fix these and submit again" if len(paths) > 1 else ""
        raise CliError("\n".join(problems) + more)
    state, store = open_store(args.state_dir)
    spooled = {write_spool_file(state.inbox, path.stem, spool_text(path, submit_dir)): path for path in paths}
    answers = _wait_for_answers(store, list(spooled), args.wait)
    refused = 0
    for inbox_file, path in spooled.items():
        answer = answers.get(inbox_file)
        if answer is None:
            print(escape(f"{names[path]} is in the spool ({inbox_file}); the daemon queues it when it runs (`oomguard daemon`)"))
        elif answer.job is not None:
            print(escape(f"job {answer.job.id} ({answer.job.name}) queued"))
        else:
            refused += 1
            why = answer.problem if answer.problem is not None else f"refused: {answer.request.answer if answer.request else ''}"
            print(f"oomguard: {escape(why, keep=chr(10))}", file=sys.stderr)
    return EXIT_FAILED if refused else EXIT_OK


def _wait_for_answers(store: Store, spooled: list[Path], wait_seconds: float) -> dict[Path, Answer]:
    """The daemon's answers, waited for until every file has one or ``wait_seconds`` pass
    without a new one (a daemon queueing a long batch keeps the wait going)."""
    answers: dict[Path, Answer] = {}
    deadline = time.monotonic() + wait_seconds
    while True:
        missing = [path for path in spooled if path not in answers]
        found = answers_to(store, missing)
        if found:
            answers.update(found)
            deadline = time.monotonic() + wait_seconds
        if len(answers) == len(spooled) or time.monotonic() >= deadline:
            return answers
        time.sleep(ASK_EVERY_SECONDS)
