"""An attempt from start to end: started through the Launcher, watched (stop deadline, stalls,
rungs the runner took itself), adopted after a daemon restart, and collected when it ended,
its Outcome read by daemon/conclude.py. Its files are opened as its owner's. Where a batch
scheduler has one is daemon/cluster_queue.py's. Over 400 lines: one attempt's life, from the
launch request to its end, with the state they share (what runs, by attempt)."""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard.daemon.as_user import child_environment, spawn_options
from oomguard.daemon.clock import Clock
from oomguard.daemon.cluster_queue import ClusterQueue
from oomguard.daemon.conclude import conclude, ended_summary
from oomguard.daemon.creep_watch import CreepWatch
from oomguard.daemon.events import Events, log_error
from oomguard.daemon.job_secrets import with_env
from oomguard.daemon.launch import Exit, Handle, Launcher, LaunchRequest, Resources
from oomguard.daemon.lifecycle import Lifecycle, State
from oomguard.daemon.monitor import GpuMonitor
from oomguard.daemon.placement import Placement
from oomguard.daemon.runner_recoveries import recorded_plans, recovery_text
from oomguard.daemon.store import Store
from oomguard.daemon.step_up_launch import launch_plan
from oomguard.daemon.store_rows import AttemptRow, JobRow
from oomguard.daemon.users import Account
from oomguard.jobs.attempt import HEARTBEAT, AttemptConfig, AttemptFiles
from oomguard.jobs.command import ATTEMPT_ENV, BOOTSTRAP_DIR, render
from oomguard.jobs.emulated_gpus import EMULATED_GPUS_ENV
from oomguard.jobs.script_report import first_schedules
from oomguard.jobs.spec import JobSpec
from oomguard.strategies import rungs
from oomguard.strategies.decision import Retry
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.step_up_history import BACK, UP
from oomguard.strategies.units import format_duration_words
from oomguard.strategies.errors import LaunchFailed, PermissionRefused

if TYPE_CHECKING:
    from oomguard.daemon.intake import Secrets
    from oomguard.daemon.scheduler import JobCache

# A runner asked to stop (SIGTERM) checkpoints first; after this long it is killed.
STOP_GRACE_SECONDS = 120.0
# An attempt without a new heartbeat for this long is reported as stalled (once).
STALL_SECONDS = 1800.0


@dataclass(frozen=True)
class Running:
    attempt_id: int
    job_id: int
    handle: Handle


def handle_of(attempt: AttemptRow) -> Handle:
    """The launcher's handle of an attempt, from its row."""
    return Handle(attempt.directory, attempt.pid, attempt.pid_started, attempt.scheduler_id)


def spec_for_attempt(job: JobRow, spec: JobSpec) -> JobSpec:
    """The job file as the next attempt runs it: checkpoints at least as often as the doctor
    asked after a time limit that passed without one (the built-in runner's)."""
    asked = job.checkpoint_every_seconds
    if asked is None or spec.command is not None:
        return spec
    every = min(asked, spec.train.checkpoint_every_seconds or asked)
    return spec.replace(train=dataclasses.replace(spec.train, checkpoint_every_seconds=every))


def resources_asked(job: JobRow, spec: JobSpec) -> Resources:
    """What the next attempt asks a batch scheduler for: the job file's [resources], with the
    host memory the doctor asked for after a host OOM at its limit."""
    wanted = spec.resources
    return Resources(
        gpus=wanted.gpus, gpu_type=wanted.gpu_type, host_memory=job.host_memory or wanted.host_memory, cpus=wanted.cpus,
        time_limit=wanted.time_limit,
    )


def owner_uid(job: JobRow) -> int:
    """The uid of the job's owner; -1 (nobody's) for a job from before owner_uid was kept
    whose user no longer exists."""
    if job.owner_uid is not None:
        return int(job.owner_uid)
    try:
        return pwd.getpwnam(job.owner).pw_uid
    except KeyError:
        return -1


def owner_of(job: JobRow) -> Account:
    if job.owner_uid is not None:
        return Account.from_uid(job.owner_uid)
    return Account.from_uid(pwd.getpwnam(job.owner).pw_uid)  # a job from before owner_uid


def files_of(store: Store, attempt: AttemptRow) -> AttemptFiles:
    """What the attempt's processes wrote, opened as its owner's: the workdir is walked to
    without following a link its owner could have put on its path, and it, attempts/, the
    attempt's folder and each file read must be the owner's (jobs/attempt.py). Its owner can
    swap any of them for a link into another user's folders at any time; the daemon (root)
    then reads nothing, never that user's files. Close it (a context manager)."""
    job = store.job(attempt.job_id)
    return AttemptFiles.owned_by(Path(os.path.abspath(attempt.directory)), owner_uid(job), job.owner)


class Attempts:
    """Starts a job's next attempt through the Launcher, watches the running ones (stop
    deadline, stalls, rungs the runner took itself, memory that creeps up), adopts what an
    earlier daemon left, and
    collects each that ended: its Outcome (conclude) recorded, and ``after`` told."""

    def __init__(
        self, store: Store, clock: Clock, launcher: Launcher, lifecycle: Lifecycle, events: Events, secrets: Secrets, jobs: JobCache, *,
        gpus: GpuMonitor | None, stall_seconds: float, after: Callable[[JobRow, Outcome], None],
        pause: Callable[[int, float], None] = lambda job_id, seconds: None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.launcher = launcher
        self.lifecycle = lifecycle
        self.events = events
        self.secrets = secrets
        self.jobs = jobs  # parsed specs and needs, kept by the scheduler
        self.gpus = gpus
        self.stall_seconds = stall_seconds
        self.after = after  # what the job does next, once its attempt's end is recorded
        self.pause = pause  # the job starts again no earlier than this many seconds from now
        self.running: dict[int, Running] = {}
        self.queue = ClusterQueue(store, clock, launcher, lifecycle, events)  # where a batch scheduler has them
        self.creep = CreepWatch(store, events, clock)

    def files_of(self, attempt: AttemptRow) -> AttemptFiles:
        return files_of(self.store, attempt)

    def start(self, job: JobRow, placement: Placement) -> bool:
        """Start the job's next attempt where the scheduler placed it (its GPUs and device).
        False when it could not start (the job has ended, saying why)."""
        gpus = placement.gpus
        spec = spec_for_attempt(job, self.jobs.spec(job))
        earlier = self.store.attempts(job.id)
        number = len(earlier) + 1
        # A command job may step back up here; a built-in job's runner is told how to itself.
        launch = launch_plan(
            job, spec, earlier, placement, self.gpus.latest if self.gpus is not None else None, restarts=not self.launcher.queues_attempts,
        )
        plan = launch.plan
        # Absolute: the shim starts in / (a --state-dir given as a relative path makes relative workdirs).
        workdir = Path(os.path.abspath(job.workdir))
        attempt_dir = workdir / "attempts" / f"{number:03d}"
        config = AttemptConfig(
            job=spec,
            plan=plan,
            number=number,
            workdir=workdir,
            device=placement.device,
            # Only the job's first attempt measures: later ones have the history. A command
            # job's script does not measure for us.
            probe=spec.ladder.probe and number == 1 and spec.command is None,
            recover_in_process=spec.ladder.in_process,
            step_up=launch.history,
        )
        try:
            owner = owner_of(job)
            spawn_options(owner)  # refused before the attempt is recorded: a user this daemon cannot run as
        except (PermissionRefused, KeyError) as error:
            self.lifecycle.end(
                job, State.FAILED, f"cannot run it as its owner {job.owner}: {error}", next_step="nothing: the job has ended; submit it again as a user that exists",
                code="unknown_owner", data={"owner": job.owner},
            )
            return False
        env = self._environment(plan, owner, gpus)
        if launch.step_up is not None:
            self.lifecycle.step_up_at_launch(job, launch.step_up, number)
        # The attempt is in the store before its process exists: a daemon that dies in between
        # finds the row and looks for it (adopt), so no attempt is started twice.
        attempt_id = self.lifecycle.start(
            job,
            number=number,
            plan=json.dumps(plan.to_dict()),
            rung=launch.rung(job),
            reason=launch.reason(job),
            directory=str(attempt_dir),
            gpus=",".join(str(i) for i in gpus) if gpus is not None else None,
            started_at=self.clock.time(),
        )
        runner, cwd = [sys.executable, "-m", "oomguard.jobs.run", str(attempt_dir)], None
        if spec.command is not None:
            runner, cwd = self._command(job, spec, plan, workdir, number, env, placement)
        request = LaunchRequest(
            attempt_dir=attempt_dir, argv=tuple(runner), env=env, owner=owner, workdir=workdir, cwd=cwd,
            stdin=json.dumps(config.to_dict(), indent=2).encode(), gpus=gpus, resources=resources_asked(job, spec),
            label=f"oomguard-{job.id}-{number}",
        )
        return self._launch(job, attempt_id, number, request, plan)

    def _command(
        self, job: JobRow, spec: JobSpec, plan: Plan, workdir: Path, number: int, env: dict[str, str], placement: Placement,
    ) -> tuple[list[str], str | None]:
        """A command job's argv and folder: the user's own script, with the plan's knobs in its
        arguments (the bootstrap reports its steps, the shim's exit.json and the log's last error
        how it ended); ``env`` gains what its processes need."""
        assert spec.command is not None
        # The store holds the job's [command.env] masked: the real values come from its secrets file.
        placed = len(placement.gpus) if placement.gpus else spec.resources.gpus
        argv, extra_env = render(with_env(spec.command, self.secrets.env(job.id)), plan, workdir, number, placed)
        env.update(extra_env)
        env.update(self._bootstrap_environment(job, spec, plan, env.get("PYTHONPATH", "")))
        env.update(placement.device.environment())
        return argv, spec.command.cwd

    def _launch(self, job: JobRow, attempt_id: int, number: int, request: LaunchRequest, plan: Plan) -> bool:
        """Start the recorded attempt; a launcher that cannot start it at all fails the job
        (False)."""
        gpus, owner = request.gpus, request.owner
        try:
            handle = self.launcher.start(request)
        except LaunchFailed as error:
            if error.retry_after is not None:
                self._launch_later(job, attempt_id, error)
                return False
            outcome = Outcome(kind="crashed", message=error.why)
            with self.store.atomic():
                self.lifecycle.end_attempt(attempt_id, outcome)
                self.lifecycle.end(
                    job, State.FAILED, outcome.message, next_step=f"nothing: the job has ended; {error.fix}, and submit it again",
                    code="spawn_failed", data={"attempt": number},
                )
            return False
        self.store.update_attempt(attempt_id, pid=handle.pid, pid_started=handle.started, scheduler_id=handle.scheduler_id)
        self.running[attempt_id] = Running(attempt_id, job.id, handle)
        # Which checkpoint it resumes from is the runner's to find (it verifies the files; the
        # daemon neither hashes gigabytes in its loop nor reads through a user's folder).
        where = f" on GPU {','.join(str(i) for i in gpus)}" if gpus is not None else ""
        started = "started"
        if handle.scheduler_id is not None:
            started, where = "submitted", f" to Slurm as job {handle.scheduler_id}"
        self.events.event(
            job, "started", f"attempt {number} {started}{where} as {owner.name} with plan [{plan.short()}]", code="started",
            data={"attempt": number, "gpus": list(gpus) if gpus is not None else None, "plan": plan.short(), "scheduler_id": handle.scheduler_id},
        )
        return True

    def _launch_later(self, job: JobRow, attempt_id: int, error: LaunchFailed) -> None:
        """Not started now, but it may be later (a cluster's controller that does not answer):
        the attempt ends interrupted (no try used up) and the job waits, then starts again."""
        assert error.retry_after is not None
        reason = f"{error.why}; trying again in {format_duration_words(error.retry_after)}"
        with self.store.atomic():
            self.lifecycle.end_attempt(attempt_id, Outcome(kind="interrupted", message=error.why))
            self.lifecycle.retry(job, Retry(reason=reason, after_seconds=error.retry_after), waiting=reason)
        self.pause(job.id, error.retry_after)

    def _environment(self, plan: Plan, owner: Account, gpus: tuple[int, ...] | None) -> dict[str, str]:
        """The attempt's environment: the owner's, the plan's (the allocator rung), its GPUs."""
        env = rungs.process_environment(plan, child_environment(owner, os.environ))
        if gpus is not None:
            # NVML numbers the cards in PCI bus order; CUDA must count them the same way.
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpus)
            if self.gpus is not None and self.gpus.source.emulated_root is not None:
                env[EMULATED_GPUS_ENV] = str(self.gpus.source.emulated_root)
        return env

    def _bootstrap_environment(self, job: JobRow, spec: JobSpec, plan: Plan, python_path: str) -> dict[str, str]:
        """What a command job's Python processes need to load jobs/bootstrap/sitecustomize.py,
        unchanged: a process that dies of an OOM (or a rank that dies) says so for the shim to
        end the attempt's other processes; each optimizer step is reported (oomguard_progress.py,
        with the first attempt's learning-rate schedules for oomguard_accelerate.py). The
        device's variables (an emulated capacity) come from the attempt's Placement."""
        schedules = None
        for earlier in self.store.attempts(job.id):  # opened one at a time: usually the first has them
            with self.files_of(earlier) as files:
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
        return env

    def adopt(self) -> None:
        """Take over what an earlier daemon left: attempts still running (by pid and start
        time), attempts that ended meanwhile (collected at the next tick from exit.json), an
        attempt recorded just before its shim was started (found by its command line), and a
        job left "running" without an attempt (queued again)."""
        for attempt in self.store.running_attempts():
            recorded = handle_of(attempt)
            handle = self.launcher.adopt(recorded, owner_uid(self.store.job(attempt.job_id)))
            if handle != recorded:
                self.store.update_attempt(attempt.id, pid=handle.pid, pid_started=handle.started, scheduler_id=handle.scheduler_id)
            self.running[attempt.id] = Running(attempt.id, attempt.job_id, handle)
        open_jobs = {attempt.job_id for attempt in self.store.running_attempts()}
        for job in self.store.running_jobs():
            if job.id not in open_jobs:
                self.lifecycle.requeue(
                    job, "found running without an attempt after a restart; it continues from its checkpoint", code="found_without_attempt",
                )

    def reap(self) -> None:
        for attempt_id, running in list(self.running.items()):
            try:
                self._reap_one(attempt_id, running)
            except Exception as error:  # noqa: BLE001 - one attempt's problem must not stop the others
                self.running.pop(attempt_id, None)
                log_error(f"collecting attempt {attempt_id}", error)
                attempt = self.store.attempt(attempt_id)
                if attempt.ended_at is None:
                    outcome = Outcome(kind="crashed", message=f"oomguard could not collect it: {type(error).__name__}: {error}")
                    self.lifecycle.end_attempt(attempt_id, outcome)
                self.lifecycle.failed_on(running.job_id, f"collecting attempt {attempt.number}", error)

    def _reap_one(self, attempt_id: int, running: Running) -> None:
        attempt = self.store.attempt(attempt_id)
        if self.launcher.running(running.handle):
            queued = self.queue.note(attempt, running.handle)
            if queued is not None and queued.never_starts:
                self.queue.give_up(attempt, running.handle, queued)
                del self.running[attempt_id]
                return
            self._enforce_stop_deadline(attempt)
            self._report_live_recoveries(attempt)
            if queued is None or queued.state == "RUNNING":  # waiting in a cluster's queue is not a stall
                self._check_stalled(attempt)
                self.creep.check(attempt, self.files_of)
            return
        del self.running[attempt_id]
        self.queue.forget(attempt_id)
        self.creep.forget(attempt_id)
        uid = owner_uid(self.store.job(attempt.job_id))
        with self.files_of(attempt) as files:
            ended = self.launcher.collect(running.handle, uid, files)
        self._finish_attempt(attempt, ended)

    def _check_stalled(self, attempt: AttemptRow) -> None:
        with self.files_of(attempt) as files:
            written = files.mtime(HEARTBEAT)
        began = max(attempt.started_at, self.queue.ran_from.get(attempt.id, 0.0))  # a cluster's queue is not a stall
        last = max(written, began) if written is not None else began
        silent = self.clock.time() - last
        if silent < self.stall_seconds:
            if attempt.stalled_at:
                self.store.update_attempt(attempt.id, stalled_at=None)  # it moves again
            return
        if attempt.stalled_at:
            return
        self.store.update_attempt(attempt.id, stalled_at=self.clock.time())
        job = self.store.job(attempt.job_id)
        self.events.event(
            job, "stalled", f"attempt {attempt.number} has written no heartbeat for {format_duration_words(silent)}",
            code="no_heartbeat", data={"attempt": attempt.number, "seconds": silent},
            next_step=f"oomguard keeps it running; look at `oomguard logs {job.id}`, and `oomguard cancel {job.id}` if it hangs",
        )

    def _enforce_stop_deadline(self, attempt: AttemptRow) -> None:
        sent = attempt.term_sent_at
        if sent and self.clock.time() - sent > STOP_GRACE_SECONDS:
            self.launcher.stop(handle_of(attempt), kill=True)

    def _finish_attempt(self, attempt: AttemptRow, ended: Exit) -> None:
        """Record how the attempt ended and what its job does next."""
        job = self.store.job(attempt.job_id)
        self.jobs.forget_need(job.id)  # its measurements change what it needs
        with self.files_of(attempt) as files:
            self._finish_from(job, attempt, files, ended)

    def _finish_from(self, job: JobRow, attempt: AttemptRow, files: AttemptFiles, ended: Exit) -> None:
        outcome = conclude(job, attempt, files, ended, self.launcher.restarted_since)
        # How the attempt ended and what the job does next are one change: a daemon that dies
        # in between finds the attempt still open and collects it again.
        with self.store.atomic():
            self.lifecycle.end_attempt(attempt.id, outcome, ended.returncode)
            self._report_recoveries(attempt, list(outcome.recoveries))
            self.events.event(
                job, "attempt-ended", ended_summary(attempt, outcome), code=outcome.kind,
                data={"attempt": attempt.number, "step": outcome.step, "phase": outcome.phase, "resumed_from": outcome.resumed_from},
            )
            self.after(job, outcome)

    def _report_live_recoveries(self, attempt: AttemptRow) -> None:
        with self.files_of(attempt) as files:
            heartbeat = files.read_json(HEARTBEAT)
        recoveries = heartbeat.get("recoveries") if isinstance(heartbeat, dict) else None
        if isinstance(recoveries, list) and all(isinstance(change, dict) for change in recoveries):
            self._report_recoveries(attempt, recoveries)

    def _report_recoveries(self, attempt: AttemptRow, changes: list[dict[str, Any]]) -> None:
        """Rungs the runner took itself (probe, in-process) are events like the daemon's, each
        reported once: while the attempt runs, or when it ends (each row read is reported from once)."""
        reported = attempt.recoveries_reported
        if len(changes) <= reported:
            return
        job = self.store.job(attempt.job_id)
        for change in changes[reported:]:
            plans = recorded_plans(change)
            if plans is None:
                # outcome.json and the heartbeat are the job owner's files: a record no runner
                # writes is not reported, and must not stop the daemon's work for everyone.
                continue
            old, new = plans
            what = recovery_text(change, old, new)
            # A step back up (jobs/step_ups.py) is an event of its own kind; its failure, like
            # any step down, an escalation.
            up = change.get("direction") == UP
            self.events.event(
                job, "stepped-up" if up else "escalated", what, code="step_up" if up else "step_up_failed" if change.get("direction") == BACK else "in_runner",
                data={"step": change["step"], "from": old.short(), "to": new.short()},
                next_step=None if up else f"the {'next attempt' if change.get('restart') else 'attempt'} goes on under [{new.short()}] in "
                f"{'a new' if change.get('restart') else 'the same'} process",
            )
        self.store.update_attempt(attempt.id, recoveries_reported=len(changes))

    def request_stop(self, attempt: AttemptRow) -> None:
        self.store.update_attempt(attempt.id, term_sent_at=self.clock.time())
        self.launcher.stop(handle_of(attempt), kill=False)
