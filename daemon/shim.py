"""The attempt shim: ``python -m oomguard.daemon.shim ATTEMPT_DIR [--workdir DIR] [--cwd DIR] [--pass-usr1] [--log-limit BYTES] -- COMMAND...``.

The daemon starts one per attempt, in a session of its own and (in system mode) as the job's
owner. The shim enters the job's workdir (--workdir), writes the attempt's configuration
(given on its standard input) into the attempt directory, starts COMMAND (the runner, or a
user's command; in --cwd, a command job's [command] cwd, else in the workdir) with its output
going to the job log, waits for it, and records how it ended in ``exit.json``.

The log: the command's standard output and error are a pipe, which the shim copies into the
attempt's log with a cap on its size (daemon/log_cap.py: output.log keeps the first bytes,
output.tail.log and output.tail.log.1 the last; --log-limit BYTES, head and tail together,
else log_cap.DEFAULT_LOG_LIMIT), so that a run of weeks cannot fill the disk. The pipe holds
shim_output.PIPE_BYTES, so the command does not wait on the shim while it is busy for a moment (stopping
ranks), and the shim goes on copying while the ranks stop, and until every writer is gone.
If the shim itself is killed (SIGKILL) while the command runs, the pipe has no reader: the
command's next write fails (SIGPIPE, or EPIPE where it ignores that), which ends most
programs. That is acceptable because such an attempt is over anyway: nothing would record its
exit, and the daemon kills what is left of a shim's attempt when it finds the shim gone
(LocalLauncher.collect; on Slurm the job ends with its batch shell); the next attempt resumes
from the last checkpoint. The shim is the last process of the attempt the kernel's OOM killer
picks (the command's score is raised, below).

Waiting costs nothing while the command runs quietly: the shim sleeps in one select on the
command's exit (a pidfd), its output (the pipe), a failure mark appearing in the attempt's
folder (inotify, through watchdog) and the signals it handles (their wakeup fd; each in
daemon/shim_wakeups.py), with a
timeout only while SIGUSR1 is to be passed on again. Where there is no pidfd (Linux before
5.3) or the folder cannot be watched (the owner's inotify instances used up), it looks every
POLL_SECONDS instead, as it always did.

Every folder of the job is entered here, as the owner, never by the daemon: the daemon starts
the shim in / (subprocess.Popen changes to its ``cwd=`` *before* it drops root's rights, so a
``cwd=`` of the user's would be entered with root's, through whatever links the user put on its
path). A workdir the owner cannot enter, or an attempt folder they cannot create, ends the shim
with CANNOT_USE_FOLDER and what went wrong on its standard error. The attempt therefore
does not depend on the daemon: a daemon that is restarted, upgraded or killed finds the exit
status there, or adopts the shim while it still runs (by pid and start time).

Nothing of the attempt outlives it. The command runs with the attempt's mark in its
environment (daemon/processes.py), and the shim is a child subreaper, so ranks that a launcher
started in sessions of their own stay findable even when the launcher dies. When a process of
the attempt records that it died of an out-of-memory error, or a rank of a multi-process job
that it died at all (jobs/bootstrap/oomguard_ranks.py), the shim brings every process of the
attempt down at once (SIGTERM, SIGKILL after a grace period) instead of leaving the other
ranks to wait out a collective's timeout; and whatever is left when the command ends is
ended too.

Host memory: the command runs with a raised OOM score, so that the kernel's OOM killer ends a
training process before the shim or the daemon, and the kernel's count of OOM kills before
and after goes into ``exit.json`` (daemon/kernel_oom.py): a SIGKILL that count explains is a
host OOM, not a crash of unknown cause.

Signals: the daemon signals the whole process group (shim and command); the shim passes the
signal on to the attempt's processes outside its group. The shim itself outlives
SIGTERM/SIGINT/SIGHUP so that it can record the command's exit; it uses a handler rather than
SIG_IGN because an ignored signal would stay ignored in the command it execs.

On a Slurm cluster the shim is the batch shell (daemon/launch/slurm.py), which Slurm sends
SIGUSR1 before the job's time limit: with --pass-usr1 it is passed on to every process of the
attempt (the runner checkpoints on it, and so does an accelerate script through the bootstrap),
which starts with SIGUSR1 ignored until it installs a handler of its own (its default would end
a command that does not handle it, without a checkpoint); otherwise it is only recorded.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from oomguard.daemon import kernel_oom, processes
from oomguard.daemon.log_cap import DEFAULT_LOG_LIMIT, MIN_LOG_LIMIT, CappedLog, check_limit
from oomguard.daemon.shim_output import DRAIN_SECONDS, CommandOutput
from oomguard.daemon.shim_signals import ignore_usr1_and_prefer_me, pass_signals_on, pass_usr1_again
from oomguard.daemon.shim_wakeups import empty, exit_descriptor, mark_watch, signal_wakeup
from oomguard.daemon.text import shorten
from oomguard.daemon.users import user_name
from oomguard.jobs.attempt import CONFIG, HEARTBEAT, METRICS, OUTCOME, SCHEDULES, write_json_atomic
from oomguard.jobs.bootstrap import oomguard_ranks
from oomguard.jobs.disk_space import is_disk_full

EXIT_STATUS = "exit.json"
# The shim's exit status when it cannot enter the workdir or create the attempt's folder in it
# (as the owner): nothing ran, and there is nowhere to write exit.json.
CANNOT_USE_FOLDER = 3
# The disk under the workdir is full (or the owner's quota used up): the shim could not make the
# attempt's folder, or could not record how the command ended. The job waits for room
# (daemon/disk_wait.py) rather than counting it as a crash, which a full disk is not.
NO_ROOM_FOR_FOLDER = 4
# The most of a failed process's error the shim's line quotes (a CUDA OOM's is ~600 characters).
ERROR_CHARS = 1000
# How often the shim looks for a failed rank's mark, and for the command's exit, where it
# cannot wait for them as events (no inotify watch, no pidfd).
POLL_SECONDS = 0.2
# How long the attempt's processes have between SIGTERM and SIGKILL once one rank has failed
# (or the command has ended with processes left over).
TEARDOWN_GRACE_SECONDS = 3.0
_PR_SET_CHILD_SUBREAPER = 36
USAGE = "usage: python -m oomguard.daemon.shim ATTEMPT_DIR [--workdir DIR] [--cwd DIR] [--pass-usr1] [--log-limit BYTES] -- COMMAND [ARG...]"


def _arguments(args: list[str]) -> tuple[Path, dict[str, str], list[str]] | None:
    """ATTEMPT_DIR [--workdir DIR] [--cwd DIR] [--pass-usr1] [--log-limit BYTES] -- COMMAND...:
    the folder, the options given ({"--workdir": DIR, "--cwd": DIR, "--pass-usr1": "",
    "--log-limit": BYTES}) and the command (None: bad usage)."""
    if not args:
        return None
    options: dict[str, str] = {}
    at = 1
    while at + 1 < len(args) and args[at] in ("--workdir", "--cwd", "--pass-usr1", "--log-limit") and args[at] not in options:
        if args[at] == "--pass-usr1":
            options[args[at]] = ""
            at += 1
            continue
        options[args[at]] = args[at + 1]
        at += 2
    if len(args) < at + 2 or args[at] != "--":
        return None
    return Path(args[0]), options, args[at + 1 :]


def _prepare(attempt_dir: Path, workdir: str | None, config: str) -> tuple[str, OSError] | None:
    """Enter the workdir and make the attempt's folder, as the owner: None, or why not (and the error)."""
    where = f"enter its workdir {workdir}"
    try:
        if workdir is not None:
            os.chdir(workdir)
        where = f"use its folder {attempt_dir}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        _clear_stale_files(attempt_dir)
        if config:
            temporary = attempt_dir / f".{CONFIG}.tmp"
            temporary.write_text(config)
            temporary.replace(attempt_dir / CONFIG)
    except OSError as error:
        return f"oomguard: the attempt cannot {where} as {user_name(os.geteuid())}: {error.strerror or error}", error
    return None


def _clear_stale_files(attempt_dir: Path) -> None:
    """A workdir used before (a job submitted again) may hold an earlier attempt's files here:
    whatever the daemon reads next must be this attempt's."""
    for stale in (OUTCOME, HEARTBEAT, METRICS, SCHEDULES, EXIT_STATUS):
        (attempt_dir / stale).unlink(missing_ok=True)
    for stale_mark in attempt_dir.glob(f"{oomguard_ranks.MARK_PREFIX}*"):
        stale_mark.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parsed = _arguments(args)
    if parsed is None:
        print(USAGE, file=sys.stderr)
        return 2
    attempt_dir, options, command = parsed
    log_limit = _log_limit(options.get("--log-limit"))
    if log_limit is None:
        print(f"--log-limit takes a number of bytes, at least {MIN_LOG_LIMIT}, not {options['--log-limit']!r}\n{USAGE}", file=sys.stderr)
        return 2
    config = sys.stdin.read()
    problem = _prepare(attempt_dir, options.get("--workdir"), config)
    if problem is None:
        try:
            log = CappedLog.with_limit(attempt_dir, log_limit)
        except OSError as error:
            problem = f"oomguard: the attempt cannot write its log in {attempt_dir} as {user_name(os.geteuid())}: {error.strerror or error}", error
    if problem is not None:
        print(problem[0], file=sys.stderr)
        return NO_ROOM_FOR_FOLDER if is_disk_full(problem[1]) else CANNOT_USE_FOLDER
    _become_subreaper()

    def ours() -> set[int]:
        return processes.of_attempt(os.getpid(), args[0])

    received = pass_signals_on(ours, pass_usr1="--pass-usr1" in options)
    environment = {**os.environ, processes.ATTEMPT_DIR_ENV: args[0]}
    with log, CommandOutput(log) as output:
        oom_kills_before = kernel_oom.kills()
        pass_usr1 = "--pass-usr1" in options
        child = _start(command, options.get("--cwd"), environment, attempt_dir, output, pass_usr1=pass_usr1)
        if child is None:
            return 127
        status: dict[str, Any] = {}
        again = (lambda: pass_usr1_again(ours, received, status)) if pass_usr1 else (lambda: None)
        returncode = _wait(child, attempt_dir, ours, output, status, again)
        left_over = processes.end_all(output.copying(ours), TEARDOWN_GRACE_SECONDS)
        output.copy_to_end(DRAIN_SECONDS)
        oom_kills = kernel_oom.kills_between(oom_kills_before, kernel_oom.kills())
        if left_over:
            _say(output, f"ended {len(left_over)} process(es) of the attempt left running after the command exited")
    _collect_orphans()
    try:
        _record_exit(attempt_dir, returncode, received, status.get("torn_down_at"), len(left_over), oom_kills)
    except OSError as error:
        if not is_disk_full(error):
            raise
        print(f"oomguard: the attempt cannot record how it ended in {attempt_dir}: {error.strerror or error}", file=sys.stderr)
        return NO_ROOM_FOR_FOLDER
    return 0


def _log_limit(given: str | None) -> int | None:
    """The log's cap: --log-limit's, else the default; None when the option is no such number."""
    if given is None:
        return DEFAULT_LOG_LIMIT
    try:
        return check_limit(int(given))
    except ValueError:
        return None


def _start(
    command: list[str], cwd: str | None, environment: dict[str, str], attempt_dir: Path, output: CommandOutput, *, pass_usr1: bool,
) -> subprocess.Popen[bytes] | None:
    """The command, started with its output going into the pipe to the log; None when it
    cannot start (said in the log, and recorded in exit.json with return code 127)."""
    try:
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=output.write_end, stderr=subprocess.STDOUT, env=environment,
            preexec_fn=ignore_usr1_and_prefer_me if pass_usr1 else kernel_oom.prefer_me,
            cwd=cwd,
        )
    except OSError as error:
        where = f" in its [command] cwd {cwd}" if cwd is not None and error.filename == cwd else ""
        # The error's own line last, shaped as Python prints it: what the attempt is summed
        # up by (Outcome.summary), naming the missing program or folder.
        output.write(f"oomguard: cannot start {command[0]}{where}: {error.strerror}\n{type(error).__name__}: {error}\n".encode())
        write_json_atomic(attempt_dir / EXIT_STATUS, {"returncode": 127, "ended_at": time.time(), "error": str(error)})
        return None
    finally:
        output.started()


def _record_exit(
    attempt_dir: Path, returncode: int, received: list[str], torn_down_at: float | None, left_over: int, oom_kills: int | None,
) -> None:
    """exit.json: how the command ended, for the daemon (now, or after a restart)."""
    marks = oomguard_ranks.recorded(str(attempt_dir))
    write_json_atomic(
        attempt_dir / EXIT_STATUS,
        {
            "returncode": returncode,
            "ended_at": time.time(),
            "signals": received,
            # The first process that recorded its failure: the attempt's cause when several did.
            "failed_process": marks[0] if marks else None,
            "torn_down_at": torn_down_at,
            "left_over": left_over,
            # The kernel's OOM kills while the attempt ran (machine-wide; None: not known).
            "oom_kills": oom_kills,
        },
    )


def _wait(
    child: subprocess.Popen[bytes], attempt_dir: Path, ours: Callable[[], set[int]], output: CommandOutput, status: dict[str, Any],
    pass_usr1_again: Callable[[], float | None],
) -> int:
    """Wait for the command, copying its output into the log; the first failed rank's mark
    brings the whole attempt down. Wakes only for an event (see the module's docstring)."""
    with ExitStack() as stack:
        events = stack.enter_context(selectors.DefaultSelector())
        events.register(output.read_end, selectors.EVENT_READ, "output")
        signalled = stack.enter_context(signal_wakeup())
        events.register(signalled, selectors.EVENT_READ, "signal")
        exited = exit_descriptor(child.pid)
        if exited is not None:
            stack.callback(os.close, exited)
            events.register(exited, selectors.EVENT_READ, "exit")
        marked = stack.enter_context(mark_watch(attempt_dir))
        if marked is not None:
            events.register(marked, selectors.EVENT_READ, "mark")
        look_for_marks = True  # once at the start too: a mark made before the watch began
        while True:
            if look_for_marks and "torn_down_at" not in status:
                _tear_down_on_a_mark(attempt_dir, ours, output, status)
            returncode = child.poll()
            if returncode is not None:
                return returncode
            due = [pass_usr1_again()]
            if exited is None or marked is None:
                due.append(POLL_SECONDS)  # what cannot be waited for is looked at, as before
            timeout = min((seconds for seconds in due if seconds is not None), default=None)
            look_for_marks = marked is None
            for key, _ in events.select(timeout):
                if key.data == "output":
                    output.copy()
                    if output.ended:  # every writer closed it; the command's exit comes next
                        events.unregister(output.read_end)
                elif key.data == "mark":
                    empty(key.fd)
                    look_for_marks = True
                elif key.data == "signal":
                    empty(key.fd)  # the handler ran; the loop looks again at what is due
                # "exit": child.poll() above


def _tear_down_on_a_mark(attempt_dir: Path, ours: Callable[[], set[int]], output: CommandOutput, status: dict[str, Any]) -> None:
    marks = oomguard_ranks.recorded(str(attempt_dir))
    if marks:
        first = marks[0]
        _say(output, f"{_who(first)} died of {_clipped(first['error'])}; stopping every process of the attempt")
        status["torn_down_at"] = time.time()
        # A process that marked its own death writes the mark before Python prints its
        # traceback, and the shim hears of the mark at once (inotify): a SIGTERM to it now would
        # cut the traceback that says what it died of. The others are stopped; it is left to
        # end by itself, and killed only when it outlives the grace period too.
        dying = {mark["pid"] for mark in marks if isinstance(mark.get("pid"), int)}
        processes.end_all(output.copying(lambda: ours() - dying), TEARDOWN_GRACE_SECONDS)
        deadline = time.monotonic() + TEARDOWN_GRACE_SECONDS
        while ours() & dying and time.monotonic() < deadline:
            output.copy()
            time.sleep(0.1)
        processes.send(ours() & dying, signal.SIGKILL)


def _who(mark: dict[str, Any]) -> str:
    """The process a failure mark is of: "rank 0 (pid 1234, python3 train.py)"."""
    program = mark.get("program")
    process = f"pid {mark['pid']}, {program}" if isinstance(program, str) and program else f"pid {mark['pid']}"
    return f"rank {mark['rank']} ({process})" if mark.get("rank") is not None else f"the process ({process})"


def _clipped(error: str) -> str:
    """An error message on one line, at most ERROR_CHARS long, cut between words."""
    return shorten(error, ERROR_CHARS)


def _say(output: CommandOutput, text: str) -> None:
    """A line of the shim's own in the log, after the command's output read so far."""
    output.copy()
    output.write(f"oomguard: {text}\n".encode())


def _become_subreaper() -> None:
    """Orphans of the command become the shim's children rather than init's, so they stay
    among its descendants (Linux; elsewhere the environment mark alone finds them)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _collect_orphans() -> None:
    """Reap the orphans that died as our children (no zombies left behind)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    sys.exit(main())
