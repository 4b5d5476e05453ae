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
ENDED_STATES = frozenset({
    "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
    "SPECIAL_EXIT", "REVOKED",
})
# How long one call of Slurm's CLI may take before the daemon gives up on it for this tick.
CLI_SECONDS = 30.0
# sbatch's answers that pass (the controller down or busy, a limit on jobs queued at once): the
# attempt is submitted again this long after, instead of failing the job.
_TRANSIENT = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Connection refused|Communication connection failure|Zero Bytes were "
    r"transmitted|temporarily unable|MaxSubmitJob|job submit limit",
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
            raise NoSlurm(f"Slurm's {', '.join(missing)} not found on PATH: install Slurm's client commands (Debian: slurm-client)")
        self.tools = {name: str(shutil.which(name)) for name in TOOLS}
        self._watched: set[str] = set()
        self._states: dict[str, QueueState] = {}
        self._polled_at = -math.inf
        self._poll_ok = False

    def check(self) -> None:
        """The controller answers (NoSlurm otherwise): said when the daemon starts, not at the first job."""
        try:
            result = self._cli(["squeue", "-h", "-j", "0"])
        except (OSError, subprocess.SubprocessError) as error:
            raise NoSlurm(f"squeue did not answer: {error}") from None
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
            raise LaunchFailed(
                f"sbatch did not answer within {CLI_SECONDS:.0f} s", "nothing: it is submitted again later", retry_after=SUBMIT_RETRY_SECONDS,
            ) from None
        except (OSError, subprocess.SubprocessError) as error:
            raise LaunchFailed(f"cannot run sbatch as {request.owner.name}: {error}", f"let {request.owner.name} run {self.tools['sbatch']}") from None
        job_id = result.stdout.strip().split(";")[0]
        if result.returncode != 0 and _TRANSIENT.search(result.stderr):
            raise LaunchFailed(
                f"sbatch could not submit it now: {_last_line(result.stderr)}", "nothing: it is submitted again later", retry_after=SUBMIT_RETRY_SECONDS,
            )
        if result.returncode != 0 or not job_id.isdigit():
            raise LaunchFailed(
                f"sbatch refused the attempt: {_last_line(result.stderr) or result.stdout.strip() or f'exit code {result.returncode}'}",
                "change the job file's [resources] (gpus, host_memory, cpus, time_limit, gpu_type) or the daemon config's [slurm] "
                "so that the cluster can run it",
            )
        self._watch(job_id, QueueState("PENDING", None, 0))
        return Handle(str(request.attempt_dir), None, None, job_id)

    def adopt(self, handle: Handle, owner_uid: int) -> Handle:
        if handle.scheduler_id is None:
            # Recorded just before sbatch returned: its job, if it was submitted, names the
            # attempt's folder in its comment. Only the owner's jobs are looked at: anyone
            # may put that folder in a comment of their own.
            result = self._cli(["squeue", "-h", "--states=all", "-u", str(owner_uid), "-o", "%i|%k"])
            for line in result.stdout.splitlines() if result.returncode == 0 else ():
                job_id, _, comment = line.partition("|")
                if comment == handle.attempt_dir and job_id.strip().isdigit():
                    handle = Handle(handle.attempt_dir, None, None, job_id.strip())
                    break
        elif not self._owned_by(handle.scheduler_id, owner_uid):
            # The recorded id names another user's job (a cluster that lost its state numbers
            # jobs anew): never taken for the attempt, which Slurm has forgotten.
            return Handle(handle.attempt_dir, None, None, None)
        if handle.scheduler_id is not None:
            self._watch(handle.scheduler_id, None)
        return handle

    def _owned_by(self, job_id: str, owner_uid: int) -> bool:
        """Is Slurm's job ``job_id`` the owner's (True too when Slurm no longer knows it: then
        nothing else is either)?"""
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
        try:
            result = self._cli(["squeue", "-h", "--states=all", "-j", ",".join(sorted(self._watched)), "-o", "%i|%T|%r"])
        except (OSError, subprocess.SubprocessError):
            self._poll_ok = False
            return
        self._poll_ok = result.returncode == 0
        if not self._poll_ok:
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
        """``scontrol show job`` of one job as its fields (None: Slurm no longer knows it)."""
        try:
            result = self._cli(["scontrol", "show", "job", "-o", job_id])
        except (OSError, subprocess.SubprocessError):
            return None
        if result.returncode != 0 or not result.stdout.strip():
            return None
        return parse_fields(result.stdout.strip().splitlines()[0])

    # Ending --------------------------------------------------------------------------------

    def collect(self, handle: Handle, owner_uid: int, files: AttemptFiles) -> Exit:
        scheduler = None
        if handle.scheduler_id is not None:
            self._watched.discard(handle.scheduler_id)
            self._states.pop(handle.scheduler_id, None)
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
        if kill or state is None or state.state != "RUNNING":
            # Killed, or never ran (pending): cancelled outright.
            self._cli(["scancel", job_id])
        else:
            # Every process of the batch job, as a local attempt's whole group: the runner
            # checkpoints and ends "interrupted", the shim records it.
            self._cli(["scancel", "--full", "--signal=TERM", job_id])

    def restarted_since(self, moment: float) -> bool:
        return False  # a node that restarts under an attempt ends it NODE_FAIL (or requeues it)

    def processes_of(self, attempts: Sequence[tuple[Handle, int]], pids: Collection[int]) -> dict[str, set[int]]:
        return {handle.attempt_dir: set() for handle, _ in attempts}  # no GPUs of this machine's are placed by

    def run_as(self, account: Account, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return run_as(account, argv, timeout)

    def _cli(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.tools[argv[0]], *argv[1:]], capture_output=True, text=True, timeout=CLI_SECONDS, stdin=subprocess.DEVNULL, cwd="/",
        )


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
    if host_memory and config.max_host_memory and host_memory > config.max_host_memory:
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
    daemon itself may run in (they would describe that job, not this one)."""
    env = {name: value for name, value in attempt_env.items() if not name.startswith(("SLURM_", "SBATCH_"))}
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
        time_limit=_time_limit(details.get("TimeLimit")), host_memory=_tres_memory(details.get("TRES")),
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


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
