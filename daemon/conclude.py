"""How an attempt ended, as one Outcome: conclude() reads whatever the attempt left (a
runner's report, the shim's exit status, the end of its log, or nothing at all), as its
owner's files. The only place the daemon turns an ended attempt into its Outcome."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.daemon.cluster_outcome import with_scheduler_end
from oomguard.daemon.launch import Exit
from oomguard.daemon.store_rows import AttemptRow, JobRow
from oomguard.jobs.attempt import OUTCOME, AttemptFiles, attempt_files, read_log_end
from oomguard.jobs.command import last_step_count
from oomguard.jobs.disk_space import DISK_FULL_TEXT, free_bytes, named_path
from oomguard.jobs.script_report import ScriptReport, read_script_report
from oomguard.strategies.oom_text import read_oom
from oomguard.strategies.outcome import SUMMED_UP_KINDS, Outcome
from oomguard.strategies.plan import Plan

# How much of the end of a silent runner's log is read for the error it died of (across the
# files a long log's end is kept in: jobs/attempt.py read_log_end), and how much of that end is
# kept in its outcome (traceback_tail: where the error it is summed up by is read).
OUTPUT_TAIL_BYTES = 256 * 1024
TRACEBACK_TAIL_CHARS = 4000


def conclude(
    job: JobRow, attempt: AttemptRow, files: AttemptFiles, ended: Exit, restarted_since: Callable[[float], bool],
) -> Outcome:
    """How the attempt ended: its runner's report (outcome.json) when it wrote one, else what
    its shim recorded and its log shows, and how a batch scheduler ended it
    (daemon/cluster_outcome.py). ``restarted_since``: did the machine restart after a
    moment (the launcher's answer), stopping whatever ran then."""
    outcome = _reported(job, files, ended)
    if outcome is not None and outcome.kind == "cancelled":
        outcome = dataclasses.replace(outcome, kind="crashed", message="reported 'cancelled', which a runner does not report")
    if outcome is not None and outcome.kind == "replan" and _command_of(job) is not None:
        outcome = dataclasses.replace(outcome, kind="crashed", next_plan=None, message="reported 'replan', which only oomguard's own runner reports")
    if ended.scheduler is not None and ended.scheduler.state is not None:
        outcome = with_scheduler_end(attempt, files, ended.scheduler, outcome)
    never_started = attempt.pid is None and attempt.scheduler_id is None
    if outcome is None and not ended.recorded and (never_started or attempt.term_sent_at or restarted_since(attempt.started_at)):
        # Never started (the daemon died first), killed after it was asked to stop, or the
        # machine restarted under it: not the job's fault, and no crash retry is used up.
        outcome = Outcome(kind="interrupted", message="stopped without a report (never started, asked to stop, or the machine restarted)")
    if outcome is None:
        plan = attempt.plan
        if files.problem is not None:
            outcome = Outcome(kind="crashed", message=f"the attempt ended, but {files.problem}")
        else:
            outcome = outcome_without_report(files, ended.returncode, ended.failed_process, ended.oom_kills, plan)
    return disk_full_of(outcome, job)


def _command_of(job: JobRow) -> Any:
    """The job's [command] (None: a built-in job, or one stored by an older oomguard whose spec
    no longer loads, which will not run again anyway)."""
    try:
        return job.spec.command
    except Exception:  # noqa: BLE001 - a job stored by an older oomguard whose spec no longer loads
        return None


def disk_full_of(outcome: Outcome, job: JobRow) -> Outcome:
    """A crash that a full disk caused ("No space left on device", "Disk quota exceeded" in the
    error it died of, or anywhere in its last chain of tracebacks: a script that caught the
    OSError and raised its own) as "disk_full": the job waits for room instead of using up its
    retries. The path is the one the error names (relative to where the command runs), else
    the workdir; how much it needs is unknown (None), and said so."""
    if outcome.kind != "crashed":
        return outcome
    error = outcome.error_line or ""
    chain = last_traceback_chain(outcome.traceback_tail or outcome.message)
    if not (DISK_FULL_TEXT.search(error) or DISK_FULL_TEXT.search(chain)):
        return outcome
    named = named_path(error) or named_path(chain)
    command = _command_of(job)
    runs_in = Path(command.cwd) if command is not None and command.cwd else Path(job.workdir)
    path = str(runs_in / named) if named else job.workdir  # an absolute name stays as it is
    return dataclasses.replace(
        outcome, kind="disk_full", disk_path=path, disk_needed=None, disk_free=free_bytes(path),
        message=f"the disk was full: {error or 'No space left on device'} (at {path}; how much room it needs is unknown)",
    )


_CHAINED = ("During handling of the above exception, another exception occurred:", "The above exception was the direct cause of the following exception:")


def last_traceback_chain(text: str) -> str:
    """The last traceback of ``text`` with the ones it was chained from (the exceptions raised
    while handling another, or from it): what the process died of, and why."""
    lines = text.splitlines()
    starts = [at for at, line in enumerate(lines) if line.lstrip().startswith("Traceback (most recent call last):")]
    if not starts:
        return ""
    first = starts[-1]
    for start in reversed(starts[:-1]):
        between = [line.strip() for line in lines[start:first]]
        if not any(marker in between for marker in _CHAINED):
            break
        first = start
    return "\n".join(lines[first:])


def _reported(job: JobRow, files: AttemptFiles, ended: Exit) -> Outcome | None:
    """The runner's report, or that nothing could run; None when neither says how it ended."""
    data = files.read_json(OUTCOME)
    outcome: Outcome | None = None
    if ended.no_room:
        # The shim found the disk full: not a crash, the job waits for room (no try used).
        outcome = Outcome(
            kind="disk_full", disk_path=job.workdir, disk_needed=None, disk_free=free_bytes(job.workdir),
            message=f"the disk was full: the attempt found no room under its workdir {job.workdir} (for its folder, or to record "
            "how it ended): No space left on device (how much room it needs is unknown)",
        )
    elif ended.no_folder:
        owner = job.owner
        outcome = Outcome(
            kind="crashed",
            message=f"the attempt could not enter its workdir {job.workdir} or make its folder there as {owner}, so nothing "
            f"ran: the workdir must be a folder {owner} owns and may enter (not replaced, and not behind a folder {owner} "
            "cannot search)",
        )
    if isinstance(data, dict):
        try:
            outcome = Outcome.from_dict(data)
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            outcome = Outcome(kind="crashed", message=f"its outcome.json cannot be read ({type(error).__name__}: {error})")
    return outcome


def ended_summary(attempt: AttemptRow, outcome: Outcome) -> str:
    """The attempt-ended event's line."""
    resumed = f"resumed from step {outcome.resumed_from}" if outcome.resumed_from is not None else "started at step 0"
    summary = f"attempt {attempt.number} ({resumed}) ended: {outcome.kind} at step {outcome.step}"
    if outcome.kind == "oom" and outcome.phase:
        summary += f" in {outcome.phase}"
    elif outcome.kind in SUMMED_UP_KINDS and outcome.summary:
        summary += f": {outcome.summary}"
    return summary


def outcome_without_report(
    attempt_dir: Path | AttemptFiles, returncode: int | None, failed_process: dict[str, Any] | None = None, oom_kills: int | None = None,
    plan: Plan | None = None,
) -> Outcome:
    """How an attempt ended whose runner wrote no outcome.json (killed, died hard, or a user
    command that does not report): an OOM its output shows (a CUDA OOM it printed, the kernel's
    OOM killer), else what the exit status says. ``returncode`` is None when no daemon watched.
    ``failed_process`` is the first process that recorded its own death (exit.json): when it
    died of an OOM, that error is the cause, whatever the other ranks printed as they were
    stopped after it. ``oom_kills`` is how many processes the kernel's OOM killer ended while
    the attempt ran (exit.json, daemon/kernel_oom.py): a failed attempt during which it struck
    ran out of host memory, even though a SIGKILL leaves no message. ``plan``: the attempt's,
    for what a command job's script reported through the bootstrap (jobs/script_report.py).
    ``attempt_dir``: the daemon passes the AttemptFiles it opened as the owner's."""
    files = attempt_files(attempt_dir)
    if returncode is None:
        fallback = Outcome(kind="crashed", message="the attempt was killed with its shim (no exit status recorded), without reporting")
    else:
        fallback = Outcome.from_exit_status(returncode)
    try:
        text = read_log_end(files, OUTPUT_TAIL_BYTES)
    except OSError:
        text = ""
    verdict = read_oom(text)
    cause = failed_process.get("error") if failed_process else None
    if isinstance(cause, str) and read_oom(cause).kind != "not_oom":
        verdict = read_oom(cause)
    # How far it got: the steps the bootstrap reported, else the script's own progress line.
    script = read_script_report(files, plan) if plan is not None else ScriptReport()
    step = script.step if script.step is not None else last_step_count(text) or 0
    measured = (script.measurement,) if script.measurement is not None else ()
    fallback = dataclasses.replace(fallback, resumed_from=script.resumed_from, measurements=measured)
    if verdict.is_device_oom:
        figures = verdict.memory_figures()
        return dataclasses.replace(
            fallback, kind="oom", step=step, memory=figures, message=verdict.message,
            measurements=measured + ((figures.measurement(plan, step),) if plan is not None else ()),
        )
    if fallback.kind == "finished":
        return dataclasses.replace(fallback, step=step, message="the command exited with code 0" + (f" at optimizer step {step}" if step else ""))
    if oom_kills and returncode not in (None, 0) and fallback.kind == "crashed":
        return dataclasses.replace(
            fallback, kind="host_oom", step=step, traceback_tail=verdict.message,
            message=f"the kernel's OOM killer ended a process of the attempt: host memory (RAM) ran out ({oom_kills} OOM "
            "kill(s) on this machine while it ran, /proc/vmstat oom_kill; `dmesg | grep -i oom` names the process)",
        )
    if verdict.kind == "host_oom":
        return dataclasses.replace(fallback, kind="host_oom", step=step, message=verdict.reason, traceback_tail=verdict.message)
    if not text:
        return fallback
    # What the attempt died of is the exception line of this tail (Outcome.summary); the first
    # process that recorded its own death (a rank) names it before the ranks stopped after it.
    message = cause if isinstance(cause, str) else fallback.message
    return dataclasses.replace(fallback, step=step, message=message, traceback_tail=text[-TRACEBACK_TAIL_CHARS:])
