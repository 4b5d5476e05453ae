"""Attempts on a Slurm cluster: one ``sbatch`` per attempt, placed and queued by Slurm.

Each attempt is a batch job whose script execs the same shim as on a local box
(daemon/shim.py), with the attempt's configuration on its standard input (a here-document:
the daemon writes nothing into the user's folders). The job asks for what the job file's
[resources] and the daemon config's [slurm] say (--gres, --mem, --cpus-per-task, --time),
is requeued by Slurm itself after a node failure or a preemption (--requeue: the same attempt
resumes from its checkpoint), and gets SIGUSR1 ``signal_seconds`` before its time limit
(--signal=B:USR1@N: the shim passes it on, and the runner checkpoints and ends "time_limit").
Its output file (slurmstepd's own lines: a time limit, a cgroup OOM kill) is
``ATTEMPT_DIR/slurm-JOBID.out``; the command's own output goes to output.log as locally.

Slurm's CLI is the interface (squeue, scontrol, scancel; no accounting, no REST): squeue is
asked once per ``poll_seconds`` for every attempt this daemon watches, and scontrol for the
details of a job whose state changed or ended. A job submitted as another user is never
adopted: adoption by the attempt's folder (the job's comment) looks among the owner's jobs.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from oomguard.daemon.as_user import spawn_options
from oomguard.daemon.config import SlurmConfig
from oomguard.daemon.launch import Exit, Handle, LaunchRequest, QueueState, SchedulerEnd
from oomguard.daemon.launch.local import SHIM_MODULE, exit_from_files, run_as
from oomguard.daemon.users import Account
from oomguard.jobs.attempt import AttemptFiles
from oomguard.strategies.errors import LaunchFailed
from oomguard.strategies.units import format_bytes, format_time_limit, parse_time_limit

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
# Ends the attempt's configuration in the batch script (JSON never has this line).
_CONFIG_END = "OOMGUARD_ATTEMPT_CONFIG"
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=")
_SLURM_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGTP]?)$")
_POWERS = {"K": 1, "M": 2, "G": 3, "T": 4, "P": 5}  # a size without a unit is in MiB


class NoSlurm(RuntimeError):
    """Slurm's commands are missing or its controller does not answer."""


class SlurmLauncher:
    def __init__(self, config: SlurmConfig, *, python: str = sys.executable, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.python = python
        self.clock = clock
        missing = [name for name in TOOLS if shutil.which(name) is None]
        if missing:
            raise NoSlurm(
                f"Slurm's {', '.join(missing)} not found on PATH ({os.environ.get('PATH', '')}): install Slurm's client commands "
                "(Debian: slurm-client), or put their folder on the daemon's PATH (a systemd unit: Environment=PATH=...)"
            )
        self.tools = {name: str(shutil.which(name)) for name in TOOLS}
        # Accounting, where the cluster has it: how a job ended after the controller forgot it.
        self.sacct = shutil.which("sacct")
        if self.sacct is not None:
            self.tools["sacct"] = self.sacct
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
            raise NoSlurm(f"squeue cannot reach the Slurm controller: {_last_line(result.stderr)}; check SLURM_CONF and slurmctld")

    # Starting ------------------------------------------------------------------------------

    def start(self, request: LaunchRequest) -> Handle:
        script = batch_script(request, self.python)
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
        self._watch(job_id, QueueState("PENDING", None, 0))
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
            self._states[job_id] = QueueState(seen[0], seen[1], restarts)

    def details(self, job_id: str) -> dict[str, str] | None:
        """``scontrol show job`` of one job as its fields; for a job the controller has
        forgotten (MinJobAge after it ended), what accounting (sacct) keeps of it, where the
        cluster has accounting; None when neither knows it."""
        result = self._cli(["scontrol", "show", "job", "-o", job_id])
        if result is not None and result.returncode == 0 and result.stdout.strip():
            return parse_fields(result.stdout.strip().splitlines()[0])
        if self.sacct is None:
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
        ended = exit_from_files(files, watched=False)
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


def batch_script(request: LaunchRequest, python: str) -> str:
    """The attempt's batch script: the shim exec'd (so that it is the batch shell, which
    --signal=B: signals), its configuration in a here-document."""
    options = ["--workdir", str(request.workdir)]
    if request.cwd:
        options += ["--cwd", request.cwd]
    # Slurm's SIGUSR1 reaches the batch shell only: the runner, and an accelerate script
    # through the bootstrap, checkpoint on it (a command that does not handle it ignores it).
    options.append("--pass-usr1")
    shim = [python, "-m", SHIM_MODULE, str(request.attempt_dir), *options, "--", *request.argv]
    config = request.stdin.decode()
    if _CONFIG_END in config.splitlines():
        raise LaunchFailed("the attempt's configuration holds the batch script's end marker", "rename what holds it in the job file")
    return f"#!/bin/sh\n# oomguard: {request.label}\nexec {shlex.join(shim)} <<'{_CONFIG_END}'\n{config.rstrip(chr(10))}\n{_CONFIG_END}\n"


def sbatch_options(request: LaunchRequest, config: SlurmConfig) -> list[str]:
    """What one attempt asks sbatch for: the job file's [resources], else the config's."""
    wanted = request.resources
    time_limit = wanted.time_limit or config.time_limit
    # A short attempt still gets the signal in time to checkpoint: at most half its limit early.
    lead = max(10, min(config.signal_seconds, time_limit // 2))
    output = str(request.attempt_dir / "slurm-%j.out").replace("%", "%%").replace("%%j", "%j")
    options = [
        "--parsable", f"--job-name={request.label}", f"--comment={request.attempt_dir}", f"--output={output}", "--open-mode=append",
        "--requeue", f"--signal=B:USR1@{lead}", f"--time={format_time_limit(time_limit)}", "--export=ALL",
    ]
    gpu_type = wanted.gpu_type or config.gpu_type
    if wanted.gpus:
        options.append(f"--gres=gpu:{gpu_type}:{wanted.gpus}" if gpu_type else f"--gres=gpu:{wanted.gpus}")
    host_memory = wanted.host_memory or config.host_memory
    if host_memory and config.max_host_memory and config.max_host_memory < host_memory < 2 * config.max_host_memory:
        host_memory = config.max_host_memory  # doubled past the most allowed: that most, once
    elif host_memory and config.max_host_memory and host_memory > config.max_host_memory:
        raise LaunchFailed(
            f"the attempt would ask for {format_bytes(host_memory)} of host memory, more than the "
            f"daemon config's slurm.max_host_memory ({format_bytes(config.max_host_memory)})",
            "raise slurm.max_host_memory in the daemon config, or make the job use less host memory",
        )
    if host_memory:
        options.append(f"--mem={math.ceil(host_memory / 2**20)}M")
    cpus = wanted.cpus or config.cpus
    if cpus:
        options.append(f"--cpus-per-task={cpus}")
    for name, value in (("partition", config.partition), ("account", config.account), ("qos", config.qos)):
        if value:
            options.append(f"--{name}={value}")
    return [*options, *config.extra_options]


def submit_environment(attempt_env: Mapping[str, str], daemon_env: Mapping[str, str]) -> dict[str, str]:
    """sbatch's environment, which the job gets (--export=ALL): the attempt's, with where the
    cluster's configuration is (SLURM_CONF) and none of the variables of a Slurm job the
    daemon itself may run in (they would describe that job, not this one), nor the GPUs the
    daemon's machine shows (the job's are Slurm's to set)."""
    env = {
        name: value for name, value in attempt_env.items()
        if not name.startswith(("SLURM_", "SBATCH_")) and name not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    }
    if "SLURM_CONF" in daemon_env:
        env["SLURM_CONF"] = daemon_env["SLURM_CONF"]
    return env


def parse_fields(line: str) -> dict[str, str]:
    """``scontrol show job -o``'s one line as {field: value}; a value may hold spaces (a path)."""
    starts = list(_FIELD.finditer(line))
    fields: dict[str, str] = {}
    for at, match in enumerate(starts):
        end = starts[at + 1].start() if at + 1 < len(starts) else len(line)
        fields[match.group(1)] = line[match.end() : end].strip()
    return fields


def scheduler_end(details: Mapping[str, str] | None) -> SchedulerEnd:
    """How Slurm ended a job, from its scontrol fields (state None: Slurm has forgotten it)."""
    if details is None:
        return SchedulerEnd(state=None)
    reason = details.get("Reason")
    return SchedulerEnd(
        state=details.get("JobState"), reason=None if reason in (None, "None") else reason,
        time_limit=_time_limit(details.get("TimeLimit")),
        # Slurm 22.05 prints TRES=; later versions AllocTRES= and ReqTRES=.
        host_memory=next((m for m in (_tres_memory(details.get(k)) for k in ("AllocTRES", "TRES", "ReqTRES")) if m is not None), None),
    )


def _time_limit(text: str | None) -> int | None:
    try:
        return parse_time_limit(text) if text else None
    except ValueError:
        return None  # UNLIMITED, Partition_Limit


def _tres_memory(text: str | None) -> int | None:
    """The mem= of a TRES list ("cpu=1,mem=100M,node=1"), in bytes (Slurm's units are powers of 1024)."""
    for item in (text or "").split(","):
        name, _, value = item.partition("=")
        match = _SLURM_SIZE.match(value) if name == "mem" else None
        if match:
            return int(float(match.group(1)) * 1024 ** _POWERS[match.group(2) or "M"])
    return None


def _int(text: str | None) -> int:
    return int(text) if text and text.isdigit() else 0


def _said(text: str) -> str:
    """What a Slurm command said on standard error, its lines in one (the code that says why is
    often on the line before the last)."""
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())[:600]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
