"""The supervisor: starts attempts, collects how they ended, and asks the doctor what next.

One `tick()` does everything that is due; the daemon and `oomguard run` call it in a loop.
All state is in the Store, so a new Supervisor over the same Store carries on where an
earlier one stopped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard.daemon import processes
from oomguard.daemon.job_secrets import public_spec, secrets_of, shows_secrets, with_env
from oomguard.daemon.monitor import GpuMonitor
from oomguard.daemon.paths import StateDir
from oomguard.daemon.placement import Holder, Need, Placed, place
from oomguard.daemon.shim import CANNOT_USE_FOLDER, EXIT_STATUS
from oomguard.daemon.spool import DEFAULT_MAX_USER_PRIORITY, Arrival, Request, Spool, priority_refusal
from oomguard.daemon.store import TERMINAL_STATES, AmbiguousJobName, JobNotFound, Store, owns
from oomguard.daemon.text import escape, escape_block
from oomguard.daemon.users import Account, PermissionRefused, check_may_change, child_environment, make_user_directory, spawn_options, system_mode
from oomguard.jobs.attempt import HEARTBEAT, LOG, OUTCOME, AttemptConfig, AttemptFiles, attempt_files, read_json
from oomguard.jobs.command import ATTEMPT_ENV, BOOTSTRAP_DIR, last_step_count, render
from oomguard.jobs.emulated_gpus import EMULATED_GPUS_ENV
from oomguard.jobs.sizes import EMULATE_DEVICE_MEMORY_ENV
from oomguard.jobs.script_report import ScriptReport, first_schedules, read_script_report
from oomguard.jobs.spec import JobSpec
from oomguard.strategies import ladder
from oomguard.strategies.doctor import GiveUp, NextPlan, PastAttempt, Retry, Wait, decide
from oomguard.strategies.memory_model import MARGIN_RAN
from oomguard.strategies.oom_text import read_oom, read_tail
from oomguard.strategies.outcome import Outcome, format_bytes
from oomguard.strategies.plan import Plan
from oomguard.strategies.planner import describe_change

if TYPE_CHECKING:
    from oomguard.daemon.notifier import Notifier

# A runner asked to stop (SIGTERM) checkpoints first; after this long it is killed.
STOP_GRACE_SECONDS = 120.0

# How much of a silent runner's output.log is read for the error it died of, and how much of
# that end is kept in its outcome (traceback_tail: where the error it is summed up by is read).
OUTPUT_TAIL_BYTES = 256 * 1024
TRACEBACK_TAIL_CHARS = 4000

# What a relaunch with other knobs keeps for a command job: the script draws its own noise per
# micro-batch, so its weights are not checked, only its schedule (jobs/script_report.py).
COMMAND_SPLIT_KEEPS = (
    "relaunched under other plans, it kept the same schedule (optimizer steps, effective batch, samples, learning "
    "rate), not bitwise-equal weights: a script draws its noise per micro-batch"
)

# An attempt without a new heartbeat for this long is reported as stalled (once).
STALL_SECONDS = 1800.0
# The scheduling pass: skipped while nothing changes, but run in full at least this often;
# and at most this long per tick (a huge queue is gone through over several ticks, so that
# attempts are still collected and systemd's watchdog still hears from the daemon).
FULL_PASS_SECONDS = 10.0
PASS_SECONDS = 1.0
# How a queued job's note begins while it waits only for a slot (status' note column).
SLOTS_TAKEN = "queued behind running job(s) "


@dataclass
class _Running:
    attempt_id: int
    job_id: int
    process: subprocess.Popen[bytes] | None  # None: adopted from an earlier daemon
    pid: int  # the shim's, which leads the attempt's session and process group
    started: int | None  # the shim's start time (processes.start_ticks)


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
        with files.open(LOG) as log:
            text = read_tail(log, max_bytes=OUTPUT_TAIL_BYTES)
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


def _past_attempt(attempt: dict[str, Any]) -> PastAttempt:
    outcome = Outcome.from_dict(json.loads(attempt["outcome"]))
    return PastAttempt(plan=outcome.plan or Plan.from_dict(json.loads(attempt["plan"])), outcome=outcome)


class Supervisor:
    def __init__(
        self,
        state: StateDir,
        store: Store,
        *,
        max_parallel: int | None = 1,
        emulate_device_memory: str | None = None,
        on_event: Callable[[dict[str, Any], str, str], None] | None = None,
        spool: Spool | None = None,
        gpus: GpuMonitor | None = None,
        notifier: Notifier | None = None,
        admin_group: str | None = None,
        stall_seconds: float = STALL_SECONDS,
        max_user_priority: int | None = DEFAULT_MAX_USER_PRIORITY,
    ) -> None:
        self.state = state
        self.store = store
        # Without GPUs to place by, attempts run max_parallel at a time (default 1); with
        # GPUs, placement decides, within max_parallel when one is given.
        self.max_parallel = max_parallel
        self.emulate_device_memory = emulate_device_memory
        self.on_event = on_event
        self.spool = spool
        self.gpus = gpus
        self.notifier = notifier
        self.admin_group = admin_group
        self.stall_seconds = stall_seconds
        # The highest priority a job from the spool may have unless its owner is root, the
        # daemon's own user or an admin (None: no cap).
        self.max_user_priority = max_user_priority
        self.stopping = False
        self.leaving = False
        self._running: dict[int, _Running] = {}
        # The scheduling pass with 10,000 queued jobs must not keep a core busy: job files are
        # parsed once, a job's need is computed again only after one of its attempts, and a
        # pass that would see what the last one saw is skipped (see _start_queued).
        self._specs: dict[int, JobSpec] = {}
        self._needs: dict[int, tuple[tuple[Any, Any], Need]] = {}
        # Jobs retried after a crash start no earlier than this (time.monotonic(); forgotten
        # by a restarted daemon, which retries at once).
        self._not_before: dict[int, float] = {}
        self._last_pass: tuple[Any, ...] | None = None
        self._last_pass_at = 0.0
        self._slots_noted: tuple[str, tuple[int, ...]] | None = None
        self._hide_stored_secrets()
        self._adopt()

    # Events and notifications ---------------------------------------------------------------

    def event(self, job: dict[str, Any], kind: str, message: str, *, next_step: str | None = None, report: str | None = None) -> None:
        """Record, print and (with ``next_step``: what its people may do) notify what happened to
        a job. ``message`` is one line whatever it quotes (a runner's message may hold newlines and
        terminal escapes: text.escape shows them), so that a user's text can never write a line of
        its own into the daemon's log; the doctor's ``report`` follows on lines of its own."""
        message = escape(message) + ("\n" + escape(report, keep="\n") if report else "")
        self.store.add_event(job["id"], kind, message)
        if self.on_event is not None:
            self.on_event(job, kind, message)
        if next_step is not None:
            self._notify(job, kind, message, next_step)

    def _notify(self, job: dict[str, Any], kind: str, message: str, next_step: str) -> None:
        if self.notifier is None:
            return
        from oomguard.daemon.notifier import JobFacts

        job = self.store.job(job["id"])
        spec = JobSpec.from_dict(json.loads(job["spec"]))
        attempts = self.store.attempts(job["id"])
        heartbeat: Any = {}
        if attempts:
            with self._files(attempts[-1]) as files:
                heartbeat = files.read_json(HEARTBEAT) or {}
        heartbeat = heartbeat if isinstance(heartbeat, dict) else {}
        outcome = json.loads(attempts[-1]["outcome"]) if attempts and attempts[-1]["outcome"] else {}
        oom = outcome.get("memory") or {}
        facts = JobFacts(
            job_id=job["id"],
            job_name=job["name"],
            user=job["owner"],
            event=kind,
            attempts=len(attempts),
            plan=Plan.from_dict(json.loads(job["plan"])).short(),
            step=outcome.get("step", heartbeat.get("step")),
            max_steps=spec.train.max_steps,
            # At an OOM: what it held plus what it asked for, against what it had.
            peak_bytes=((oom.get("allocated") or 0) + (oom.get("requested") or 0)) or heartbeat.get("peak_bytes"),
            cap_bytes=oom.get("total") or heartbeat.get("capacity_bytes"),
            summary=message.splitlines()[0],
            next_step=next_step,
            gpus=(attempts[-1]["gpus"] or "") if attempts else "",
        )
        self.notifier.notify(facts, urls=self._secret_urls(job["id"]), tags=spec.notify.tags, events=spec.notify.events)

    # Secrets: a job's [command.env] values and its own notification URLs are kept out of the
    # shared store (it holds them masked: job_secrets.public_spec) in a file only the daemon can
    # read, STATE/secrets/<id>.json; from there they go into the job's processes and to apprise.

    def _secrets_file(self, job_id: int) -> Path:
        return self.state.secrets / f"{job_id}.json"

    def _save_secrets(self, job_id: int, secrets: dict[str, Any]) -> None:
        path = self._secrets_file(job_id)
        if not secrets:
            path.unlink(missing_ok=True)  # an earlier job of this id (a transaction rolled back) left it
            return
        self.state.secrets.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(secrets, handle)

    def _secrets(self, job_id: int) -> dict[str, Any]:
        data = read_json(self._secrets_file(job_id))
        return data if isinstance(data, dict) else {}

    def _secret_urls(self, job_id: int) -> tuple[str, ...]:
        return tuple(self._secrets(job_id).get("urls") or ())

    def _hide_stored_secrets(self) -> None:
        """Jobs stored by an older oomguard hold their [command.env] values (and webhook paths)
        in clear in the store, which every user may read: their secrets move to the secrets
        files (for jobs that may still run), the store keeps the masked form, and SQLite
        overwrites the old text it frees (secure_delete) and folds its WAL back into the file."""
        stored = [(job["id"], job["state"], json.loads(job["spec"])) for job in self.store.jobs()]
        leaking = [(job_id, state, spec) for job_id, state, spec in stored if shows_secrets(spec)]
        if not leaking:
            return
        self.store.db.execute("PRAGMA secure_delete = ON")
        with self.store.atomic():
            for job_id, state, spec in leaking:
                if state not in TERMINAL_STATES:
                    # The file holds the real URLs already (the store had them redacted); the env is new.
                    self._save_secrets(job_id, {**secrets_of(spec), **self._secrets(job_id)})
                self.store.update_job(job_id, spec=json.dumps(public_spec(spec)))
        self.store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.store.db.execute("PRAGMA secure_delete = OFF")
        print(f"oomguard: moved the [command.env] values and notification URLs of {len(leaking)} job(s) out of the store", flush=True)

    # Jobs -----------------------------------------------------------------------------------

    def add_job(self, spec: JobSpec, owner: Account, spool_file: str | None = None, workdir: str | None = None) -> int:
        full = spec.to_dict()
        # The store keeps the masked form; the secrets file is written in the same transaction,
        # so that no job is queued whose secrets were never written.
        with self.store.atomic():
            job_id = self.store.add_job(
                name=spec.name,
                owner=owner.name,
                owner_uid=owner.uid,
                spec=public_spec(full),
                priority=spec.priority,
                workdir=workdir or spec.workdir,
                plan=spec.initial_plan().to_dict(),
                spool_file=spool_file,
                emulate_device_memory=self.emulate_device_memory,
                jobs_root=self.state.jobs,
            )
            self._save_secrets(job_id, secrets_of(full))
        job = self.store.job(job_id)
        try:
            self._prepare_workdir(job, owner, default=not (workdir or spec.workdir))
        except PermissionRefused as error:
            self._end_job(job, "failed", f"cannot use its workdir: {error}", next_step="nothing: fix the workdir and submit the job again")
            return job_id
        self.event(job, "queued", f"queued (owner {owner.name}, batch {spec.train.batch_size}, {spec.train.max_steps} steps, workdir {job['workdir']})")
        return job_id

    def _prepare_workdir(self, job: dict[str, Any], owner: Account, *, default: bool) -> None:
        """The job's workdir, owned by its owner: under the state directory the daemon makes it
        and hands it over; anywhere else it is made as the owner, so the kernel checks the
        owner may write there, and kept under its real path as the owner resolves it (the
        daemon later opens it without following links its users could make: _files)."""
        workdir = Path(job["workdir"])
        if default:
            workdir.mkdir(mode=0o750, parents=True, exist_ok=True)
            if system_mode() and owner.uid != os.geteuid():
                os.chown(workdir, owner.uid, owner.gid)
            return
        real = str(make_user_directory(workdir, owner))
        if real != job["workdir"]:
            self.store.update_job(job["id"], workdir=real)
            job["workdir"] = real

    def _files(self, attempt: dict[str, Any]) -> AttemptFiles:
        """What the attempt's processes wrote, opened as its owner's: the workdir is walked to
        without following a link its owner could have put on its path, and it, attempts/, the
        attempt's folder and each file read must be the owner's (jobs/attempt.py). Its owner can
        swap any of them for a link into another user's folders at any time; the daemon (root)
        then reads nothing, never that user's files. Close it (a context manager)."""
        job = self.store.job(attempt["job_id"])
        return AttemptFiles.owned_by(Path(os.path.abspath(attempt["directory"])), self._owner_uid(job), job["owner"])

    def _owner_uid(self, job: dict[str, Any]) -> int:
        """The uid of the job's owner; -1 (nobody's) for a job from before owner_uid was kept
        whose user no longer exists."""
        if job["owner_uid"] is not None:
            return int(job["owner_uid"])
        try:
            return pwd.getpwnam(job["owner"]).pw_uid
        except KeyError:
            return -1

    def _owner(self, job: dict[str, Any]) -> Account:
        if job["owner_uid"] is not None:
            return Account.from_uid(job["owner_uid"])
        return Account.from_uid(pwd.getpwnam(job["owner"]).pw_uid)  # a job from before owner_uid

    def active(self) -> bool:
        return bool(self._running)

    def tick(self) -> None:
        """Everything that is due. One bad file, job or attempt must not stop the others: each
        is handled on its own, and an error is recorded against it (see _failed_on)."""
        self._take_spool()
        self._handle_cancellations()
        if self.gpus is not None:
            try:
                self.gpus.tick()
            except Exception as error:  # noqa: BLE001 - a lost GPU must not stop the daemon
                self._log_error("sampling the GPUs", error)
        self._reap()
        if not self.stopping:
            self._start_queued()

    def _log_error(self, what: str, error: BaseException) -> None:
        tail = "".join(traceback.format_exception(error))[-3000:]
        # An error may quote what a user wrote: one line, then the traceback indented below it.
        print(escape_block(f"oomguard: error while {what}: {type(error).__name__}: {error}", tail), flush=True)

    def _failed_on(self, job_id: int, what: str, error: BaseException) -> None:
        """An error of oomguard's while handling one job: the job ends, failed, with the error
        recorded and its people told, instead of the same error at every tick."""
        self._log_error(f"{what} (job {job_id})", error)
        job = self.store.job(job_id)
        if job["state"] not in TERMINAL_STATES:
            self._end_job(
                job, "failed", f"oomguard failed while {what}: {type(error).__name__}: {error}",
                next_step="nothing: the job has ended; the daemon's log has the details; submit it again, and report the error",
            )

    # Spool ----------------------------------------------------------------------------------

    def _take_spool(self) -> None:
        if self.spool is None:
            return
        for path in self.spool.pending():
            try:
                self._take_file(path)
            except Exception as error:  # noqa: BLE001 - one bad file never stops the daemon
                self._log_error(f"reading {path.name} from the spool", error)
                try:
                    self.spool.reject(path, f"{path.name}: oomguard could not read it: {type(error).__name__}: {error}")
                except OSError as move_error:
                    self._log_error(f"moving {path.name} to rejected/", move_error)

    def _take_file(self, path: Path) -> None:
        assert self.spool is not None
        if self._taken_before(path):
            return
        result = self.spool.take(path)
        if isinstance(result, Arrival):
            try:
                spawn_options(result.owner)  # a daemon not run as root runs only its own user's jobs
                refusal = priority_refusal(result.owner, result.spec.priority, self.max_user_priority, self.admin_group, path.name)
                if refusal is not None:
                    raise PermissionRefused(refusal)
            except PermissionRefused as error:
                rejection = self.spool.reject(path, str(error))
                # The CLI that wrote the file finds the refusal by the file's name, as an answer.
                self.store.add_request(
                    file=result.spool_file, requester=result.owner.name, action="submit", job_key=result.spec.name,
                    job_id=None, accepted=0, answer=rejection.error,
                )
                print(f"rejected {path.name}: {rejection.error}", flush=True)
                return
            job_id = self.add_job(result.spec, result.owner, spool_file=result.spool_file)
            self.spool.accept(path, job_id)
        elif isinstance(result, Request):
            self._answer(result)
            self.spool.consume(path)
        else:
            print(f"rejected {result.file}: {result.error}", flush=True)

    def _taken_before(self, path: Path) -> bool:
        """An inbox file whose name the store has recorded already: the daemon recorded it and
        died before moving it (finish that), or someone else's file under a name that was used
        (refused: a CLI finds its answer by the name of its file, so a name is never answered
        twice, and never for another user). True when the file has been dealt with here."""
        assert self.spool is not None
        job = self.store.job_by_spool_file(path.name)
        request = self.store.request_by_file(path.name) if job is None else None
        if job is None and request is None:
            return False
        try:
            owner = self.spool.owner(path)  # lstat: a link is refused by take(), like any other
        except FileNotFoundError:
            return True
        except PermissionRefused:
            return False
        used = None
        if job is not None:
            if not owns(job, owner.uid, owner.name):
                used = f"job {job['id']} of {job['owner']}"
            elif os.path.lexists(self.spool.accepted / f"{job['id']:06d}-{path.name}"):
                used = f"your job {job['id']} ({job['name']})"
            else:  # recorded before a crash that came before the move: just finish the move
                self.spool.accept(path, job["id"])
                return True
        elif request is not None:
            if request["requester"] != owner.name:
                used = f"a file of {request['requester']}"
            elif request["action"] == "submit":  # a job file refused earlier (moved to rejected/ first)
                used = f"your job file refused at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(request['at']))}"
            else:  # answered before a crash that came before the removal
                self.spool.consume(path)
                return True
        error = (
            f"{path.name}: this name was used already, by {used}; the daemon answers each name once, so give the file a new "
            "name (`oomguard submit` and `oomguard cancel` pick a new unguessable one each time)"
        )
        print(f"rejected {path.name}: {self.spool.reject(path, error).error}", flush=True)
        return True

    def _answer(self, request: Request) -> None:
        """Apply a user's request about a job if they may; the answer goes to the store, where
        the CLI that wrote the request reads it."""
        job: dict[str, Any] | None = None
        try:
            if request.action != "cancel":
                raise PermissionRefused(f"unknown request {request.action!r} (oomguard knows: cancel)")
            # A name means the requester's own job first (Store.job_for); the CLI sends an id.
            job = self.store.job_for(request.job, request.requester.uid, request.requester.name)
            label = f"job {job['id']} ({job['name']})"
            check_may_change(request.requester, self._owner(job).uid, "cancel", label, self.admin_group)
            if job["state"] in TERMINAL_STATES:
                raise PermissionRefused(f"{label} has already ended: {job['state']}")
        except (PermissionRefused, JobNotFound, AmbiguousJobName) as error:
            answer, accepted = str(error), False
        else:
            self.store.request_cancel(job["id"])
            answer, accepted = f"cancel requested for {label} by {request.requester.name}: the daemon checkpoints and stops it", True
            self.event(job, "cancel-requested", f"by {request.requester.name}")
        self.store.add_request(
            file=request.spool_file, requester=request.requester.name, action=request.action, job_key=request.job,
            job_id=job["id"] if job else None, accepted=int(accepted), answer=answer,
        )
        if not accepted:
            print(f"refused a request of {request.requester.name}: {answer}", flush=True)

    # Starting -------------------------------------------------------------------------------

    def _start_queued(self) -> None:
        queued = self.store.queued_jobs()
        if not queued:
            return
        limit = self.max_parallel if self.max_parallel is not None else (None if self.gpus is not None else 1)
        if limit is not None and len(self._running) >= limit:
            self._note_slots_taken(limit, queued)
            return
        # What the GPUs hold is read once per pass, and again only after an attempt started.
        gpus = self.gpus.read() if self.gpus is not None else None
        # Nothing changed since the last pass (the same queue, the same attempts, the GPUs'
        # free memory within 1/256 of each card): its answers stand. A full pass still runs every
        # FULL_PASS_SECONDS, for what time changes (a job waiting too long).
        seen = (
            tuple((job["id"], job["plan"], job["wait_free_bytes"], job["cancel_requested"]) for job in queued),
            tuple(sorted(self._running)),
            tuple((g.index, g.free * 256 // max(g.total, 1), len(g.processes)) for g in gpus) if gpus is not None else None,
        )
        due = any(when <= time.monotonic() for when in self._not_before.values())
        if seen == self._last_pass and not due and time.monotonic() - self._last_pass_at < min(FULL_PASS_SECONDS, self.stall_seconds):
            return
        self._last_pass, self._last_pass_at = seen, time.monotonic()
        holders = self._holders(gpus) if gpus is not None else {}
        answers: dict[Need, Placed | Any] = {}  # jobs with the same need get the same answer
        deadline = time.monotonic() + PASS_SECONDS
        for job in queued:
            if limit is not None and len(self._running) >= limit:
                self._note_slots_taken(limit, queued)
                return
            if time.monotonic() > deadline:
                self._last_pass = None  # the rest of the queue next tick
                return
            if job["cancel_requested"]:
                continue
            not_before = self._not_before.get(job["id"])
            if not_before is not None:
                if time.monotonic() < not_before:
                    continue
                del self._not_before[job["id"]]
            try:
                started = self._try_to_start(job, gpus, holders, answers)
            except Exception as error:  # noqa: BLE001 - one job's problem must not stop the queue
                self._failed_on(job["id"], "starting an attempt", error)
                continue
            if started and gpus is not None:
                gpus = self.gpus.read()  # type: ignore[union-attr]
                holders = self._holders(gpus)
                answers.clear()

    def _note_slots_taken(self, limit: int, queued: list[dict[str, Any]]) -> None:
        """Queued jobs that wait only for a slot say so, and for which jobs (status' note);
        written when the note or the queue changed, not at every tick."""
        running = ", ".join(str(job_id) for job_id in sorted(r.job_id for r in self._running.values()))
        why = f"--max-parallel {limit}" if self.max_parallel is not None else "without GPUs the daemon runs one at a time; --max-parallel raises it"
        note = f"{SLOTS_TAKEN}{running} ({why})"
        noted = (note, tuple(job["id"] for job in queued))
        if noted != self._slots_noted:
            self.store.note_waiting(note, replaces=SLOTS_TAKEN)
            self._slots_noted = noted

    def _spec(self, job: dict[str, Any]) -> JobSpec:
        """The job's spec, parsed once (a job's file never changes once it is queued)."""
        spec = self._specs.get(job["id"])
        if spec is None:
            spec = self._specs[job["id"]] = JobSpec.from_dict(json.loads(job["spec"]))
        return spec

    def _try_to_start(self, job: dict[str, Any], gpus: list[Any] | None, holders: dict[int, list[Holder]], answers: dict[Need, Any]) -> bool:
        """Start the job's next attempt where it fits; False (and why, in the job) when it waits.
        A job that can never fit (more GPUs than the box has) waits like any other, saying so,
        and is reported stalled after --stall-after: a card may only be lost for a while."""
        placed: tuple[int, ...] | None = None
        if gpus is not None:
            need = self._need(job, self._spec(job))
            if need not in answers:
                answers[need] = place(need, gpus, holders)
            where = answers[need]
            if not isinstance(where, Placed):
                # Lower-priority jobs may still fit elsewhere: the caller looks at them too. The
                # reason is an event when it changes in words, not with every byte of free memory.
                if job["waiting"] is None or _without_numbers(job["waiting"]) != _without_numbers(where.reason):
                    self.store.update_job(job["id"], waiting=where.reason, waiting_since=job["waiting_since"] or time.time())
                    self.event(job, "waiting", where.reason)
                self._check_waiting_too_long(job, where.reason)
                return False
            placed = where.gpus
        self._start_attempt(job, placed)
        return True

    def _check_waiting_too_long(self, job: dict[str, Any], reason: str) -> None:
        """A job that has waited for a GPU as long as a silent attempt would be stalled is
        reported the same way, once per wait: someone may have to free a GPU."""
        since = job["waiting_since"]
        if since is None or time.time() - since < self.stall_seconds or self.store.has_event_since(job["id"], "stalled", since):
            return
        waited = time.time() - since
        self.event(
            job, "stalled", f"queued and waiting for {_how_long(waited)}: {reason}",
            next_step="oomguard keeps waiting and starts it as soon as a GPU has room; free one (`oomguard gpus` shows what is on them), or cancel it",
        )

    def _need(self, job: dict[str, Any], spec: JobSpec) -> Need:
        """What the job needs free per GPU: after contention, what it waits for; else the peak
        its plan measured (with the margin of a plan that ran); else what the job file says.
        Kept until one of the job's attempts starts or ends (the only times it changes)."""
        cached = self._needs.get(job["id"])
        if cached is not None and cached[0] == (job["plan"], job["wait_free_bytes"]):
            return cached[1]
        need = self._measure_need(job, spec)
        self._needs[job["id"]] = ((job["plan"], job["wait_free_bytes"]), need)
        return need

    def _measure_need(self, job: dict[str, Any], spec: JobSpec) -> Need:
        free_bytes: int | None = job["wait_free_bytes"]
        if free_bytes is None:
            plan = Plan.from_dict(json.loads(job["plan"]))
            peaks = [
                m.peak_bytes
                for attempt in self.store.attempts(job["id"])
                if attempt["outcome"]
                for m in Outcome.from_dict(json.loads(attempt["outcome"])).measurements
                if m.fits and m.plan == plan
            ]
            free_bytes = int(max(peaks) * (1 + MARGIN_RAN)) if peaks else spec.resources.memory
        return Need(gpus=spec.resources.gpus, share=spec.resources.share, free_bytes=free_bytes)

    def _holders(self, gpus: list[Any]) -> dict[int, list[Holder]]:
        holders: dict[int, list[Holder]] = {}
        # Which attempt each process on a GPU belongs to: its mark, or the shim's group.
        marked = processes.marks() if any(g.processes for g in gpus) else {}
        for attempt in self.store.running_attempts():
            if not attempt["gpus"]:
                continue
            job = self.store.job(attempt["job_id"])
            spec = self._spec(job)
            need = self._need(job, spec)
            owner = self._owner_uid(job)
            for index in (int(i) for i in attempt["gpus"].split(",")):
                used = sum(
                    p.used_bytes for g in gpus if g.index == index for p in g.processes
                    if (marked.get(p.pid) == attempt["directory"] and processes.real_uid(p.pid) == owner) or _in_group(p.pid, attempt["pid"])
                )
                holders.setdefault(index, []).append(Holder(job["id"], spec.resources.share, need.free_bytes, used))
        return holders

    def _start_attempt(self, job: dict[str, Any], gpus: tuple[int, ...] | None) -> None:
        spec = self._spec(job)
        plan = Plan.from_dict(json.loads(job["plan"]))
        number = len(self.store.attempts(job["id"])) + 1
        # Absolute: the shim starts in / (a --state-dir given as a relative path makes relative workdirs).
        workdir = Path(os.path.abspath(job["workdir"]))
        attempt_dir = workdir / "attempts" / f"{number:03d}"
        config = AttemptConfig(
            job=spec,
            plan=plan,
            number=number,
            workdir=workdir,
            emulate_device_memory=job["emulate_device_memory"],
            # Only the job's first attempt measures: later ones have the history. A command
            # job's script does not measure for us.
            probe=spec.ladder.probe and number == 1 and spec.command is None,
        )
        try:
            owner = self._owner(job)
            credentials = spawn_options(owner)
        except (PermissionRefused, KeyError) as error:
            self._end_job(job, "failed", f"cannot run it as its owner {job['owner']}: {error}", next_step="nothing: the job has ended; submit it again as a user that exists")
            return
        env = ladder.process_environment(plan, child_environment(owner, os.environ))
        if gpus is not None:
            # NVML numbers the cards in PCI bus order; CUDA must count them the same way.
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpus)
            if self.gpus is not None and self.gpus.source.emulated_root is not None:
                env[EMULATED_GPUS_ENV] = str(self.gpus.source.emulated_root)
        # The attempt is in the store before its process exists: a daemon that dies in between
        # finds the row and looks for the shim (_adopt), so no attempt is started twice.
        now = time.time()
        with self.store.atomic():
            attempt_id = self.store.add_attempt(
                job_id=job["id"],
                number=number,
                plan=json.dumps(plan.to_dict()),
                rung=job["next_rung"],
                reason=job["next_reason"],
                directory=str(attempt_dir),
                gpus=",".join(str(i) for i in gpus) if gpus is not None else None,
                started_at=now,
            )
            self.store.update_job(
                job["id"], state="running", started_at=job["started_at"] or now, next_rung=None, next_reason=None, waiting=None, wait_free_bytes=None,
                waiting_since=None,
            )
        runner = [sys.executable, "-m", "oomguard.jobs.run", str(attempt_dir)]
        # Every folder of the job is entered by the shim, as the job's owner, never by the
        # daemon: Popen changes to its cwd= before it drops root's rights, so the shim starts
        # in / and enters the workdir itself (daemon/shim.py). The daemon (root, in system
        # mode) must not enter a folder for them that they may not, follow a link they put on
        # its path, nor tell them, by failing here or not, whether a folder exists that they
        # cannot see.
        shim_options = ["--workdir", str(workdir)]
        if spec.command is not None:
            # The user's own script, with the plan's knobs in its arguments: the bootstrap
            # reports its steps, the shim's exit.json and the log's last error how it ended.
            # The store holds the job's [command.env] masked: the real values come from its secrets file.
            runner, extra_env = render(with_env(spec.command, self._secrets(job["id"]).get("env") or {}), plan, workdir, number)
            env.update(extra_env)
            if spec.command.cwd:
                shim_options += ["--cwd", spec.command.cwd]
            env.update(self._bootstrap_environment(job, spec, plan, env.get("PYTHONPATH", "")))
        # The shim (as the owner, in a session of its own) writes attempt.json from its
        # standard input, runs the runner and records its exit status for any daemon to read.
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "oomguard.daemon.shim", str(attempt_dir), *shim_options, "--", *runner],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                cwd="/",
                start_new_session=True,
                **credentials,
            )
        except OSError as error:
            outcome = Outcome(kind="crashed", message=f"cannot start the attempt's shim ({sys.executable}) as {owner.name}: {error.strerror or error}")
            with self.store.atomic():
                self.store.update_attempt(attempt_id, ended_at=time.time(), outcome_kind=outcome.kind, outcome=json.dumps(outcome.to_dict()))
                self._end_job(
                    job, "failed", outcome.message,
                    next_step=f"nothing: the job has ended; let {owner.name} run {sys.executable} (README: For installers), and submit it again",
                )
            return
        started = processes.start_ticks(process.pid)
        self.store.update_attempt(attempt_id, pid=process.pid, pid_started=started)
        assert process.stdin is not None
        try:
            process.stdin.write(json.dumps(config.to_dict(), indent=2).encode())
            process.stdin.close()
        except BrokenPipeError:
            pass  # the shim died at once; reaping it records how
        self._running[attempt_id] = _Running(attempt_id, job["id"], process, process.pid, started)
        # Which checkpoint it resumes from is the runner's to find (it verifies the files; the
        # daemon neither hashes gigabytes in its loop nor reads through a user's folder).
        where = f" on GPU {','.join(str(i) for i in gpus)}" if gpus is not None else ""
        self.event(job, "started", f"attempt {number} started{where} as {owner.name} with plan [{plan.short()}]")

    def _bootstrap_environment(self, job: dict[str, Any], spec: JobSpec, plan: Plan, python_path: str) -> dict[str, str]:
        """What a command job's Python processes need to load jobs/bootstrap/sitecustomize.py,
        unchanged: a process that dies of an OOM (or a rank that dies) says so for the shim to
        end the attempt's other processes; each optimizer step is reported (oomguard_progress.py,
        with the first attempt's learning-rate schedules for oomguard_accelerate.py); under
        emulation the script's tensors count against the emulated capacity."""
        schedules = None
        for earlier in self.store.attempts(job["id"]):  # opened one at a time: usually the first has them
            with self._files(earlier) as files:
                schedules = first_schedules([files])
            if schedules:
                break
        env = {
            ATTEMPT_ENV: json.dumps({
                "plan": plan.short(), "max_steps": spec.train.max_steps, "batch_size": plan.batch_size,
                "first_schedules": schedules,
            }),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(BOOTSTRAP_DIR), python_path])),
        }
        if job["emulate_device_memory"]:
            env[EMULATE_DEVICE_MEMORY_ENV] = job["emulate_device_memory"]
        return env

    # Ending ---------------------------------------------------------------------------------

    def _adopt(self) -> None:
        """Take over what an earlier daemon left: attempts still running (by pid and start
        time), attempts that ended meanwhile (collected at the next tick from exit.json), an
        attempt recorded just before its shim was started (found by its command line), and a
        job left "running" without an attempt (queued again)."""
        for attempt in self.store.running_attempts():
            pid, started = attempt["pid"], attempt["pid_started"]
            if pid is None:
                found = _find_shim(attempt["directory"])
                if found is not None:
                    pid, started = found
                    self.store.update_attempt(attempt["id"], pid=pid, pid_started=started)
            self._running[attempt["id"]] = _Running(attempt["id"], attempt["job_id"], None, pid, started)
        open_jobs = {attempt["job_id"] for attempt in self.store.running_attempts()}
        for job in self.store.db.query("select * from jobs where state = 'running'"):
            if job["id"] not in open_jobs:
                self.store.update_job(job["id"], state="queued")
                self.event(job, "requeued", "found running without an attempt after a restart; it continues from its checkpoint")

    def _reap(self) -> None:
        for attempt_id, running in list(self._running.items()):
            try:
                self._reap_one(attempt_id, running)
            except Exception as error:  # noqa: BLE001 - one attempt's problem must not stop the others
                self._running.pop(attempt_id, None)
                self._log_error(f"collecting attempt {attempt_id}", error)
                attempt = self.store.db["attempts"].get(attempt_id)
                if attempt["ended_at"] is None:
                    outcome = Outcome(kind="crashed", message=f"oomguard could not collect it: {type(error).__name__}: {error}")
                    self.store.update_attempt(attempt_id, ended_at=time.time(), outcome_kind=outcome.kind, outcome=json.dumps(outcome.to_dict()))
                self._failed_on(running.job_id, f"collecting attempt {attempt['number']}", error)

    def _reap_one(self, attempt_id: int, running: _Running) -> None:
        attempt = self.store.db["attempts"].get(attempt_id)
        if running.process is not None:
            alive = running.process.poll() is None
        else:
            alive = running.pid is not None and processes.is_running(running.pid, running.started)
        if alive:
            self._enforce_stop_deadline(attempt)
            self._report_live_recoveries(attempt)
            self._check_stalled(attempt)
            return
        del self._running[attempt_id]
        if running.pid is not None:
            # The shim is gone; whatever of its group is left (a runner whose shim was killed)
            # must not go on writing into the workdir beside the next attempt.
            _kill_group(running.pid)
            # Ranks that left the group (a session of their own) and outlived the shim.
            # Only the owner's: anyone may mark a process of their own with this attempt's folder.
            processes.send(processes.marked_with(attempt["directory"], self._owner_uid(self.store.job(attempt["job_id"]))), signal.SIGKILL)
        with self._files(attempt) as files:
            status = files.read_json(EXIT_STATUS)
        if not isinstance(status, dict):
            status = None
        returncode = status.get("returncode") if status and isinstance(status.get("returncode"), int) else None
        failed = status.get("failed_process") if status and isinstance(status.get("failed_process"), dict) else None
        oom_kills = status.get("oom_kills") if status and isinstance(status.get("oom_kills"), int) else None
        # A shim of ours that could not enter the workdir, as the owner, had nowhere to write.
        no_folder = status is None and running.process is not None and running.process.returncode == CANNOT_USE_FOLDER
        self._finish_attempt(
            attempt, returncode, shim_recorded=status is not None or running.process is not None, failed_process=failed, oom_kills=oom_kills,
            no_folder=no_folder,
        )

    def _check_stalled(self, attempt: dict[str, Any]) -> None:
        with self._files(attempt) as files:
            written = files.mtime(HEARTBEAT)
        last = max(written, attempt["started_at"]) if written is not None else attempt["started_at"]
        silent = time.time() - last
        if silent < self.stall_seconds:
            if attempt["stalled_at"]:
                self.store.update_attempt(attempt["id"], stalled_at=None)  # it moves again
            return
        if attempt["stalled_at"]:
            return
        self.store.update_attempt(attempt["id"], stalled_at=time.time())
        job = self.store.job(attempt["job_id"])
        self.event(
            job, "stalled", f"attempt {attempt['number']} has written no heartbeat for {_how_long(silent)}",
            next_step=f"oomguard keeps it running; look at `oomguard logs {job['id']}`, and `oomguard cancel {job['id']}` if it hangs",
        )

    def _enforce_stop_deadline(self, attempt: dict[str, Any]) -> None:
        sent = attempt["term_sent_at"]
        if sent and time.time() - sent > STOP_GRACE_SECONDS:
            self._signal(attempt, signal.SIGKILL)

    def _signal(self, attempt: dict[str, Any], signum: int) -> None:
        pid, started = attempt["pid"], attempt["pid_started"]
        if pid is None or not processes.is_running(pid, started):
            return  # not started yet, or gone (its pid may belong to someone else by now)
        if signum == signal.SIGKILL:
            # Nothing handles SIGKILL: the ranks in sessions of their own are killed here, not
            # by the shim (SIGTERM reaches them through the shim).
            processes.send(processes.of_attempt(pid, attempt["directory"]), signum)
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    def _finish_attempt(
        self,
        attempt: dict[str, Any],
        returncode: int | None,
        shim_recorded: bool = True,
        failed_process: dict[str, Any] | None = None,
        oom_kills: int | None = None,
        no_folder: bool = False,
    ) -> None:
        """Record how the attempt ended and what its job does next. ``no_folder``: its shim
        could not enter the workdir or make the attempt's folder there (shim.CANNOT_USE_FOLDER)."""
        job = self.store.job(attempt["job_id"])
        self._needs.pop(job["id"], None)  # its measurements change what it needs
        with self._files(attempt) as files:
            self._finish_from(job, attempt, files, returncode, shim_recorded, failed_process, oom_kills, no_folder)

    def _finish_from(
        self, job: dict[str, Any], attempt: dict[str, Any], files: AttemptFiles, returncode: int | None, shim_recorded: bool,
        failed_process: dict[str, Any] | None, oom_kills: int | None, no_folder: bool,
    ) -> None:
        data = files.read_json(OUTCOME)
        outcome: Outcome | None = None
        if no_folder:
            owner = job["owner"]
            outcome = Outcome(
                kind="crashed",
                message=f"the attempt could not enter its workdir {job['workdir']} or make its folder there as {owner}, so nothing "
                f"ran: the workdir must be a folder {owner} owns and may enter (not replaced, and not behind a folder {owner} "
                "cannot search)",
            )
        if isinstance(data, dict):
            try:
                outcome = Outcome.from_dict(data)
            except (TypeError, ValueError, KeyError, AttributeError) as error:
                outcome = Outcome(kind="crashed", message=f"its outcome.json cannot be read ({type(error).__name__}: {error})")
        if outcome is None and not shim_recorded and (attempt["pid"] is None or attempt["term_sent_at"] or _booted_after(attempt["started_at"])):
            # Never started (the daemon died first), killed after it was asked to stop, or the
            # machine restarted under it: not the job's fault, and no crash retry is used up.
            outcome = Outcome(kind="interrupted", message="stopped without a report (never started, asked to stop, or the machine restarted)")
        if outcome is None:
            plan = Plan.from_dict(json.loads(attempt["plan"]))
            if files.problem is not None:
                outcome = Outcome(kind="crashed", message=f"the attempt ended, but {files.problem}")
            else:
                outcome = outcome_without_report(files, returncode, failed_process, oom_kills, plan)
        if outcome.kind == "cancelled":
            outcome = dataclasses.replace(outcome, kind="crashed", message="reported 'cancelled', which a runner does not report")
        # How the attempt ended and what the job does next are one change: a daemon that dies
        # in between finds the attempt still open and collects it again.
        with self.store.atomic():
            self.store.update_attempt(
                attempt["id"],
                ended_at=time.time(),
                outcome_kind=outcome.kind,
                outcome=json.dumps(outcome.to_dict()),
                exit_code=outcome.exit_code if outcome.exit_code is not None else returncode,
                resumed_from=outcome.resumed_from,
            )
            resumed = f"resumed from step {outcome.resumed_from}" if outcome.resumed_from is not None else "started at step 0"
            summary = f"attempt {attempt['number']} ({resumed}) ended: {outcome.kind} at step {outcome.step}"
            if outcome.kind == "oom" and outcome.phase:
                summary += f" in {outcome.phase}"
            elif outcome.kind in ("crashed", "host_oom", "diverged") and outcome.summary:
                summary += f": {outcome.summary}"
            self._report_recoveries(attempt, list(outcome.recoveries))
            self.event(job, "attempt-ended", summary)
            self._next_step(job, outcome)

    def _end_command_job(self, job: dict[str, Any]) -> None:
        """A finished command job, checked against its target (the steps of its job file, the
        learning rate its first attempt's schedule ends at), with what its relaunches kept."""
        spec = self._spec(job)
        attempts = self.store.attempts(job["id"])
        last = attempts[-1]
        with self._files(last) as files:
            end = read_script_report(files, Plan.from_dict(json.loads(last["plan"]))).end_state(spec.train.max_steps)
        result = f"the command exited with code 0; {end.describe()}"
        if len({a["plan"] for a in attempts}) > 1:
            result += f"; {COMMAND_SPLIT_KEEPS}"
        next_step = "nothing: the script has written its results"
        if end.differences:
            next_step = f"check the script's results: it did not end where the job file says (`oomguard show {job['id']}`)"
        self._end_job(job, "finished", result, next_step=next_step)

    def _next_step(self, job: dict[str, Any], outcome: Outcome) -> None:
        spec = self._spec(job)
        if outcome.kind == "finished":
            if spec.command is not None:
                self._end_command_job(job)
                return
            final = Path(job["workdir"]) / "final"
            self._end_job(job, "finished", f"finished {outcome.step} steps; final model in {final}", next_step=f"nothing: the final model is in {final}")
            return
        if job["cancel_requested"]:
            self._end_job(job, "cancelled", f"cancelled at step {outcome.step} (checkpoint kept in {job['workdir']})")
            return
        if outcome.kind == "interrupted" and self.stopping:
            self.store.update_job(job["id"], state="queued")
            self.event(job, "requeued", f"stopped with the daemon at step {outcome.step}; it resumes when the daemon starts again")
            return
        # The plan the attempt ended under: its probe or an in-process recovery may have
        # moved it from the one it started with.
        plan = outcome.plan or Plan.from_dict(json.loads(job["plan"]))
        history = [_past_attempt(a) for a in self.store.attempts(job["id"]) if a["outcome"]]
        decision = decide(outcome, plan, history, spec.policy())
        if isinstance(decision, (Retry, Wait)) and outcome.plan is not None:
            self.store.update_job(job["id"], plan=json.dumps(outcome.plan.to_dict()))
        if isinstance(decision, NextPlan):
            self.store.update_job(
                job["id"], state="queued", plan=json.dumps(decision.plan.to_dict()), next_rung=decision.rung, next_reason=decision.reason
            )
            self.event(
                job, "escalated", f"rung {decision.rung}: {decision.reason}",
                next_step=f"the next attempt runs under [{decision.plan.short()}] from the last checkpoint",
            )
        elif isinstance(decision, Wait):
            waiting = f"waiting for {format_bytes(decision.free_bytes)} free after a neighbour's spike"
            self.store.update_job(
                job["id"], state="queued", next_rung=None, next_reason=decision.reason, waiting=waiting, wait_free_bytes=decision.free_bytes
            )
            self.event(job, "contention", decision.reason)
        elif isinstance(decision, Retry):
            waiting = None
            if decision.after_seconds > 0:
                self._not_before[job["id"]] = time.monotonic() + decision.after_seconds
                ended = f"{outcome.kind}: {outcome.summary}" if outcome.summary else outcome.kind
                waiting = f"retrying {decision.after_seconds:.0f} s after the attempt ended ({ended})"
            self.store.update_job(job["id"], state="queued", next_rung=None, next_reason=decision.reason, waiting=waiting)
            self.event(job, "retry", decision.reason)
        elif isinstance(decision, GiveUp):
            self._end_job(
                job, "failed", decision.reason, report=decision.report,
                next_step=f"nothing more: the job has ended; `oomguard show {job['id']}` has the report; {decision.next_step}",
            )

    def _report_live_recoveries(self, attempt: dict[str, Any]) -> None:
        with self._files(attempt) as files:
            heartbeat = files.read_json(HEARTBEAT)
        recoveries = heartbeat.get("recoveries") if isinstance(heartbeat, dict) else None
        if isinstance(recoveries, list) and all(isinstance(change, dict) for change in recoveries):
            self._report_recoveries(attempt, recoveries)

    def _report_recoveries(self, attempt: dict[str, Any], changes: list[dict[str, Any]]) -> None:
        """Rungs the runner took itself (probe, in-process) are events like the daemon's, each
        reported once: while the attempt runs, or when it ends."""
        reported = attempt["recoveries_reported"] or 0
        if len(changes) <= reported:
            return
        job = self.store.job(attempt["job_id"])
        for change in changes[reported:]:
            old, new = Plan.from_dict(change["from"]), Plan.from_dict(change["to"])
            what = f"at step {change['step']}, in the runner: [{old.short()}] -> [{new.short()}]: "
            if isinstance(change.get("oom"), str):
                # An OOM the runner recovered from itself: what ran out, what changed, and that
                # training went on, in words (the daemon's log is what people read).
                what += f"{change['oom']} -> {describe_change(old, new)}; {change['reason']}; resumed at step {change['step']} in the same process"
            else:
                what += change["reason"]
            self.event(job, "escalated", what, next_step=f"the attempt goes on under [{new.short()}] in the same process")
        self.store.update_attempt(attempt["id"], recoveries_reported=len(changes))
        attempt["recoveries_reported"] = len(changes)

    def _end_job(self, job: dict[str, Any], state: str, result: str, report: str | None = None, next_step: str | None = None) -> None:
        self._specs.pop(job["id"], None)
        self._needs.pop(job["id"], None)
        self.store.update_job(job["id"], state=state, ended_at=time.time(), result=result, report=report, waiting=None, waiting_since=None)
        self.event(job, state, result, next_step=next_step, report=report)

    # Cancelling and stopping ----------------------------------------------------------------

    def _handle_cancellations(self) -> None:
        for job in self.store.db.query("select * from jobs where cancel_requested = 1 and state in ('queued', 'running')"):
            if job["state"] == "queued":
                self._end_job(job, "cancelled", "cancelled before its next attempt started")
                continue
            for attempt in self.store.running_attempts():
                if attempt["job_id"] == job["id"] and not attempt["term_sent_at"]:
                    self._request_stop(attempt)
                    self.event(job, "cancelling", f"asked attempt {attempt['number']} to checkpoint and stop")

    def _request_stop(self, attempt: dict[str, Any]) -> None:
        self.store.update_attempt(attempt["id"], term_sent_at=time.time())
        self._signal(attempt, signal.SIGTERM)

    def stop_all(self) -> None:
        """Ask every running attempt to checkpoint and stop; their jobs go back to the queue."""
        self.stopping = True
        for attempt in self.store.running_attempts():
            if not attempt["term_sent_at"]:
                self._request_stop(attempt)

    def leave_all(self) -> None:
        """Stop supervising and leave running attempts running: they are in sessions of their
        own, and the next daemon adopts them (or collects how they ended meanwhile)."""
        self.stopping = True
        self.leaving = True

    def stopped(self) -> bool:
        """Nothing left to wait for: attempts stopped, or left to the next daemon."""
        return self.stopping and (self.leaving or not self.active())

    def job_done(self, job_id: int) -> bool:
        return self.store.job(job_id)["state"] in TERMINAL_STATES


def _how_long(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"


def _without_numbers(text: str) -> str:
    return re.sub(r"[0-9.]+", "#", text)


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left of it (a process group id is not reused while it has members)


def _booted_after(moment: float) -> bool:
    """Did the machine start after ``moment`` (so whatever ran then was stopped by a reboot)?"""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return int(line.split()[1]) > moment
    return False


def _find_shim(attempt_dir: str) -> tuple[int, int | None] | None:
    """The shim of ``attempt_dir`` among the running processes, by its command line."""
    wanted = [b"oomguard.daemon.shim", attempt_dir.encode()]
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            arguments = (pid_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(arguments) > 3 and arguments[1:3] == [b"-m", wanted[0]] and arguments[3] == wanted[1]:
            started = processes.start_ticks(int(pid_dir.name))
            if started is not None:
                return int(pid_dir.name), started
    return None


def _in_group(pid: int, group: int) -> bool:
    """Is ``pid`` in the process group ``group`` (an attempt's shim leads its group)?"""
    try:
        return os.getpgid(pid) == group
    except OSError:
        return False
