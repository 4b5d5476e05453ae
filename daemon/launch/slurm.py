"""Attempts on a Slurm cluster: one ``sbatch`` per attempt, placed and queued by Slurm.

Each attempt is a batch job whose script execs the same shim as on a local box
(daemon/shim.py), with the attempt's configuration on its standard input (a here-document:
the daemon writes nothing into the user's folders). The job asks for what the job file's
[resources] and the daemon config's [slurm] say (--gres, --mem, --cpus-per-task, --time),
is requeued by Slurm itself after a node failure or a preemption (--requeue: the same attempt
resumes from its checkpoint), and gets SIGUSR1 ``signal_seconds`` before its time limit
(--signal=B:USR1@N: the shim passes it on, and the runner checkpoints and ends "time_limit").
Its output file (slurmstepd's own lines: a time limit, a cgroup OOM kill) is
``ATTEMPT_DIR/slurm-JOBID.out``; the command's own output goes to output.log as locally (with
its cap, and its end in the tail files: daemon/log_cap.py).

Slurm's CLI is the interface (squeue, scontrol, scancel, and sacct where the cluster keeps
accounting; no REST): squeue is asked once per ``poll_seconds`` for every attempt this daemon
watches, and scontrol for the details of a job whose state changed or ended. What goes to the
CLI and comes back, as text, is daemon/launch/slurm_text.py's. A job submitted as another user is never
adopted: adoption by the attempt's folder (the job's comment) looks among the owner's jobs.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence

from oomguard.daemon.as_user import spawn_options
from oomguard.daemon.config import SlurmConfig
from oomguard.daemon.launch import Exit, Handle, LaunchRequest, QueueState
from oomguard.daemon.launch.local import exit_from_files, run_as
from oomguard.daemon.launch.slurm_text import batch_script, parse_fields, queue_state, sbatch_options, scheduler_end, submit_environment
from oomguard.daemon.log_cap import check_limit
from oomguard.daemon.users import Account
from oomguard.jobs.attempt import AttemptFiles
from oomguard.strategies.errors import LaunchFailed

TOOLS = ("sbatch", "squeue", "scontrol", "scancel")
# A job in one of these states has ended (squeue --states=all lists it for MinJobAge after).
# (SPECIAL_EXIT is a held requeue an administrator may release; REVOKED, a federated sibling
# that may run elsewhere: neither has ended for good, and status shows them.)
ENDED_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"})
# How long one call of Slurm's CLI may take before the daemon gives up on it for this tick.
CLI_SECONDS = 30.0
# sbatch's answers that pass (the controller down or busy, a limit on jobs queued at once): the
# attempt is submitted again this long after, instead of failing the job.
_TRANSIENT = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Connection refused|Communication connection failure|Zero Bytes were "
    r"transmitted|temporarily unable|MaxSubmitJob",
    re.IGNORECASE,
)
SUBMIT_RETRY_SECONDS = 60.0

class NoSlurm(RuntimeError):
    """Slurm's commands are missing or its controller does not answer."""


class SlurmLauncher:
    queues_attempts = True

    def __init__(
        self, config: SlurmConfig, *, python: str = sys.executable, clock: Callable[[], float] = time.monotonic, log_limit_bytes: int | None = None,
    ) -> None:
        """``log_limit_bytes``: the cap on each attempt's log, head and tail together
        (daemon/log_cap.py; ValueError below its least); None: the shim's default."""
        self.config = config
        self.log_limit_bytes = check_limit(log_limit_bytes) if log_limit_bytes is not None else None
        self.python = python
        self.clock = clock
        found = {name: shutil.which(name) for name in (*TOOLS, "sacct")}
        missing = [name for name in TOOLS if found[name] is None]
        if missing:
            raise NoSlurm(
                f"Slurm's {', '.join(missing)} not found on PATH ({os.environ.get('PATH', '')}): install Slurm's client commands "
                "(Debian: slurm-client), or put their folder on the daemon's PATH (a systemd unit: Environment=PATH=...)"
            )
        # sacct, where the cluster has it: how a job ended after the controller forgot it.
        self.tools = {name: path for name, path in found.items() if path is not None}
        self._watched: set[str] = set()
        self._states: dict[str, QueueState] = {}
        self._owners: dict[str, int] = {}  # each watched job's owner: scancel acts on the owner's jobs only
        self._polled_at = -math.inf
        self._poll_ok = False

    def check(self) -> None:
        """The controller answers (NoSlurm otherwise): said when the daemon starts, not at the first job."""
        result = self._cli(["squeue", "-h", "-j", "0"])
        if result is None:
            raise NoSlurm(f"squeue did not answer within {CLI_SECONDS:.0f} s; check SLURM_CONF and slurmctld")
        if result.returncode != 0 and "Invalid job id" not in result.stderr:
            raise NoSlurm(f"squeue cannot reach the Slurm controller: {_said(result.stderr)}; check SLURM_CONF and slurmctld")

    # Starting ------------------------------------------------------------------------------

    def start(self, request: LaunchRequest) -> Handle:
        script = batch_script(request, self.python, log_limit_bytes=self.log_limit_bytes)
        options = sbatch_options(request, self.config)
        # As the owner: the folder for Slurm's output file (it must exist before the job
        # runs), then sbatch, so that the job is the owner's. In /, like every process the
        # daemon starts for a user (Popen enters cwd= before it drops root's rights).
        argv = ["/bin/sh", "-c", 'mkdir -p -- "$1" && shift && exec "$@"', "oomguard-sbatch", str(request.attempt_dir), self.tools["sbatch"], *options]
        try:
            result = subprocess.run(
                argv, input=script, capture_output=True, text=True, env=submit_environment(request.env, os.environ), cwd="/",
                timeout=CLI_SECONDS, **spawn_options(request.owner),
            )
        except subprocess.TimeoutExpired:
            result = None
        except (OSError, subprocess.SubprocessError) as error:
            raise LaunchFailed(f"cannot run sbatch as {request.owner.name}: {error}", f"let {request.owner.name} run {self.tools['sbatch']}") from None
        job_id = result.stdout.strip().split(";")[0] if result is not None else ""
        if result is None or (result.returncode != 0 and _TRANSIENT.search(result.stderr)):
            # The controller may have taken the job before the answer was lost: look for it
            # (by its folder, among the owner's) before the attempt is given up and submitted
            # again, or two trainings would share the workdir.
            found = self._find_by_folder(str(request.attempt_dir), request.owner.uid)
            if found is None:
                said = f"sbatch did not answer within {CLI_SECONDS:.0f} s" if result is None else f"sbatch could not submit it now: {_said(result.stderr)}"
                raise LaunchFailed(said, "nothing: it is submitted again later", retry_after=SUBMIT_RETRY_SECONDS)
            job_id = found
        elif result.returncode != 0 or not job_id.isdigit():
            raise LaunchFailed(
                f"sbatch refused the attempt: {_said(result.stderr) or result.stdout.strip() or f'exit code {result.returncode}'}",
                "change the job file's [resources] (gpus, host_memory, cpus, time_limit, gpu_type) or the daemon config's [slurm] "
                "so that the cluster can run it",
            )
        self._owners[job_id] = request.owner.uid
        self._watch(job_id, queue_state("PENDING", None, 0))
        return Handle(str(request.attempt_dir), None, None, job_id)

    def adopt(self, handle: Handle, owner_uid: int) -> Handle:
        if handle.scheduler_id is None:
            # Recorded just before sbatch returned: its job, if it was submitted, names the
            # attempt's folder in its comment.
            found = self._find_by_folder(handle.attempt_dir, owner_uid)
            if found is not None:
                handle = Handle(handle.attempt_dir, None, None, found)
        elif not self._owned_by(handle.scheduler_id, owner_uid):
            # The recorded id names another user's job (a cluster that lost its state numbers
            # jobs anew): never taken for the attempt, which Slurm has forgotten.
            return Handle(handle.attempt_dir, None, None, None)
        if handle.scheduler_id is not None:
            self._owners[handle.scheduler_id] = owner_uid
            self._watch(handle.scheduler_id, None)
        return handle

    def _find_by_folder(self, attempt_dir: str, owner_uid: int) -> str | None:
        """The owner's job whose comment is the attempt's folder. Only the owner's jobs are
        looked at: anyone may put that folder in a comment of their own."""
        result = self._cli(["squeue", "-h", "--states=all", "-u", str(owner_uid), "-o", "%i|%k"])
        for line in result.stdout.splitlines() if result is not None and result.returncode == 0 else ():
            job_id, _, comment = line.partition("|")
            if comment == attempt_dir and job_id.strip().isdigit():
                return job_id.strip()
        return None

    def _owned_by(self, job_id: str, owner_uid: int) -> bool:
        """Is Slurm's job ``job_id`` the owner's (True too when Slurm no longer knows it: then
        nothing else is either; cancelling it is limited to the owner's jobs all the same)?"""
        details = self.details(job_id)
        if details is None:
            return True
        match = re.search(r"\((\d+)\)$", details.get("UserId", ""))
        return match is not None and int(match.group(1)) == owner_uid

    def _watch(self, job_id: str, state: QueueState | None) -> None:
        self._watched.add(job_id)
        if state is not None:
            self._states[job_id] = state
        else:
            self._polled_at = -math.inf  # a job not seen yet: ask at the next look

    # Watching ------------------------------------------------------------------------------

    def running(self, handle: Handle) -> bool:
        if handle.scheduler_id is None:
            return False  # never submitted
        self._refresh()
        state = self._states.get(handle.scheduler_id)
        if state is None:
            # Not listed by an squeue that answered: ended long enough ago to be forgotten.
            # Unknown while the controller does not answer: still running, as far as we know.
            return not self._poll_ok
        return state.state not in ENDED_STATES

    def queue_state(self, handle: Handle) -> QueueState | None:
        return self._states.get(handle.scheduler_id) if handle.scheduler_id is not None else None

    def _refresh(self) -> None:
        """Every watched job's state, at most once per poll_seconds (one squeue call)."""
        now = self.clock()
        if not self._watched or now - self._polled_at < self.config.poll_seconds:
            return
        self._polled_at = now
        result = self._cli(["squeue", "-h", "--states=all", "-j", ",".join(sorted(self._watched)), "-o", "%i|%T|%r"])
        # Asked for one job Slurm has forgotten, squeue fails with "Invalid job id" (for several
        # it leaves the forgotten ones out): an answer, that it is not listed.
        self._poll_ok = result is not None and (result.returncode == 0 or "Invalid job id" in result.stderr)
        if not self._poll_ok or result is None:
            return
        listed: dict[str, tuple[str, str | None]] = {}
        for line in result.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0].isdigit():
                listed[parts[0]] = (parts[1], None if parts[2] in ("None", "") else parts[2])
        for job_id in self._watched:
            seen = listed.get(job_id)
            if seen is None:
                self._states.pop(job_id, None)
                continue
            known = self._states.get(job_id)
            restarts = known.restarts if known is not None else 0
            if known is None or (known.state, known.reason) != seen:
                # Changed: how often Slurm requeued it is in scontrol's view only.
                details = self.details(job_id)
                restarts = _int(details.get("Restarts")) if details else restarts
            self._states[job_id] = queue_state(seen[0], seen[1], restarts)

    def details(self, job_id: str) -> dict[str, str] | None:
        """``scontrol show job`` of one job as its fields; for a job the controller has
        forgotten (MinJobAge after it ended), what accounting (sacct) keeps of it, where the
        cluster has accounting; None when neither knows it."""
        result = self._cli(["scontrol", "show", "job", "-o", job_id])
        if result is not None and result.returncode == 0 and result.stdout.strip():
            return parse_fields(result.stdout.strip().splitlines()[0])
        if "sacct" not in self.tools:
            return None
        accounted = self._cli(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,State,Reason,Timelimit,ReqTRES,User,UID"])
        if accounted is None or accounted.returncode != 0:
            return None
        for line in accounted.stdout.splitlines():
            parts = line.split("|")
            if len(parts) == 7 and parts[0] == job_id:
                # In scontrol's field names, for one reader ("CANCELLED by 1000" is sacct's state).
                state, reason, limit, tres, user, uid = parts[1:]
                return {"JobState": state.split()[0] if state else "", "Reason": reason, "TimeLimit": limit, "ReqTRES": tres, "UserId": f"{user}({uid})"}
        return None

    # Ending --------------------------------------------------------------------------------

    def collect(self, handle: Handle, owner_uid: int, files: AttemptFiles) -> Exit:
        scheduler = None
        if handle.scheduler_id is not None:
            self._watched.discard(handle.scheduler_id)
            self._states.pop(handle.scheduler_id, None)
            self._owners.pop(handle.scheduler_id, None)
            details = self.details(handle.scheduler_id)
            scheduler = scheduler_end(details)
        # Whatever Slurm says, the shim's exit.json says how the command ended.
        ended = exit_from_files(files)
        return Exit(
            returncode=ended.returncode, recorded=ended.recorded, failed_process=ended.failed_process, oom_kills=ended.oom_kills,
            scheduler=scheduler,
        )

    def stop(self, handle: Handle, *, kill: bool) -> None:
        job_id = handle.scheduler_id
        if job_id is None:
            return
        state = self._states.get(job_id)
        # Only ever the owner's job, whatever the id names by now (the daemon may be root).
        owner = [f"--user={self._owners[job_id]}"] if job_id in self._owners else []
        if kill or state is None or state.state != "RUNNING":
            # Killed, or never ran (pending): cancelled outright.
            self._cli(["scancel", *owner, job_id])
        else:
            # Every process of the batch job, as a local attempt's whole group: the runner
            # checkpoints and ends "interrupted", the shim records it.
            self._cli(["scancel", "--full", "--signal=TERM", *owner, job_id])

    def restarted_since(self, moment: float) -> bool:
        return False  # a node that restarts under an attempt ends it NODE_FAIL (or requeues it)

    def processes_of(self, attempts: Sequence[tuple[Handle, int]], pids: Collection[int]) -> dict[str, set[int]]:
        return {handle.attempt_dir: set() for handle, _ in attempts}  # no GPUs of this machine's are placed by

    def run_as(self, account: Account, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return run_as(account, argv, timeout)

    def _cli(self, argv: list[str]) -> subprocess.CompletedProcess[str] | None:
        """One of Slurm's commands; None when it could not run or did not answer in time (the
        caller tries again at a later tick: a slow controller must not stop the daemon)."""
        try:
            return subprocess.run(
                [self.tools[argv[0]], *argv[1:]], capture_output=True, text=True, timeout=CLI_SECONDS, stdin=subprocess.DEVNULL, cwd="/",
            )
        except (OSError, subprocess.SubprocessError) as error:
            print(f"oomguard: {argv[0]} did not answer: {error}", file=sys.stderr, flush=True)
            return None


def _int(text: str | None) -> int:
    return int(text) if text and text.isdigit() else 0


def _said(text: str) -> str:
    """What a Slurm command said on standard error, its lines in one (the code that says why is
    often on the line before the last)."""
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())[:600]
