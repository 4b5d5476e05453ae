"""The supervisor: starts attempts, collects how they ended, and asks the doctor what next.

One `tick()` does everything that is due; the daemon and `oomguard run` call it in a loop.
All state is in the Store, so a new Supervisor over the same Store carries on where an
earlier one stopped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.daemon.paths import StateDir
from oomguard.daemon.spool import Arrival, Spool
from oomguard.daemon.store import TERMINAL_STATES, Store
from oomguard.jobs import checkpoints
from oomguard.jobs.attempt import HEARTBEAT, LOG, OUTCOME, AttemptConfig, read_json
from oomguard.jobs.spec import JobSpec
from oomguard.strategies import ladder
from oomguard.strategies.doctor import GiveUp, NextPlan, PastAttempt, Retry, decide
from oomguard.strategies.oom_text import read_oom_log
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan

# A runner asked to stop (SIGTERM) checkpoints first; after this long it is killed.
STOP_GRACE_SECONDS = 120.0

# How much of a silent runner's output.log is read for the error it died of.
OUTPUT_TAIL_BYTES = 256 * 1024


@dataclass
class _Running:
    attempt_id: int
    job_id: int
    process: subprocess.Popen[bytes] | None  # None: adopted from an earlier daemon
    pid: int


def _process_alive(pid: int, attempt_dir: str) -> bool:
    """True if ``pid`` is still our runner for ``attempt_dir`` (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return attempt_dir.encode() in cmdline


def outcome_without_report(attempt_dir: Path, returncode: int | None) -> Outcome:
    """How an attempt ended whose runner wrote no outcome.json (killed, died hard, or a user
    command that does not report): an OOM its output shows (a CUDA OOM it printed, the kernel's
    OOM killer), else what the exit status says. ``returncode`` is None when no daemon watched."""
    if returncode is None:
        fallback = Outcome(kind="crashed", message="the runner ended while no daemon was watching, without reporting")
    else:
        fallback = Outcome.from_exit_status(returncode)
    try:
        verdict = read_oom_log(attempt_dir / LOG, max_bytes=OUTPUT_TAIL_BYTES)
    except OSError:
        return fallback
    if verdict.is_device_oom:
        return Outcome(kind="oom", memory=verdict.memory_figures(), message=verdict.message, exit_code=fallback.exit_code)
    if verdict.kind == "host_oom":
        return Outcome(kind="host_oom", message=verdict.reason, traceback_tail=verdict.message, exit_code=fallback.exit_code)
    return dataclasses.replace(fallback, traceback_tail=verdict.message)


def _past_attempt(attempt: dict[str, Any]) -> PastAttempt:
    outcome = Outcome.from_dict(json.loads(attempt["outcome"]))
    return PastAttempt(plan=outcome.plan or Plan.from_dict(json.loads(attempt["plan"])), outcome=outcome)


class Supervisor:
    def __init__(
        self,
        state: StateDir,
        store: Store,
        *,
        max_parallel: int = 1,
        emulate_device_memory: str | None = None,
        on_event: Callable[[dict[str, Any], str, str], None] | None = None,
        spool: Spool | None = None,
    ) -> None:
        self.state = state
        self.store = store
        self.max_parallel = max_parallel
        self.emulate_device_memory = emulate_device_memory
        self.on_event = on_event
        self.spool = spool
        self.stopping = False
        self.leaving = False
        self._running: dict[int, _Running] = {}
        self._adopt()

    # Events ---------------------------------------------------------------------------------

    def event(self, job: dict[str, Any], kind: str, message: str) -> None:
        self.store.add_event(job["id"], kind, message)
        if self.on_event is not None:
            self.on_event(job, kind, message)

    # Jobs -----------------------------------------------------------------------------------

    def add_job(self, spec: JobSpec, owner: str, spool_file: str | None = None, workdir: str | None = None) -> int:
        job_id = self.store.add_job(
            name=spec.name,
            owner=owner,
            spec=spec.to_dict(),
            priority=spec.priority,
            workdir=workdir or spec.workdir,
            plan=spec.initial_plan().to_dict(),
            spool_file=spool_file,
            emulate_device_memory=self.emulate_device_memory,
            jobs_root=self.state.jobs,
        )
        job = self.store.job(job_id)
        self.event(job, "queued", f"queued (owner {owner}, batch {spec.train.batch_size}, {spec.train.max_steps} steps, workdir {job['workdir']})")
        return job_id

    def active(self) -> bool:
        return bool(self._running)

    def tick(self) -> None:
        self._take_spool()
        self._handle_cancellations()
        self._reap()
        if not self.stopping:
            self._start_queued()

    # Spool ----------------------------------------------------------------------------------

    def _take_spool(self) -> None:
        if self.spool is None:
            return
        for path in self.spool.pending():
            existing = self.store.job_by_spool_file(path.name)
            if existing is not None:
                # Recorded before a crash that came before the move: just finish the move.
                self.spool.accept(path, existing["id"])
                continue
            result = self.spool.take(path)
            if isinstance(result, Arrival):
                job_id = self.add_job(result.spec, result.owner, spool_file=result.spool_file)
                self.spool.accept(path, job_id)
            else:
                print(f"rejected {result.file}: {result.error}", flush=True)

    # Starting -------------------------------------------------------------------------------

    def _start_queued(self) -> None:
        for job in self.store.queued_jobs():
            if len(self._running) >= self.max_parallel:
                return
            if job["cancel_requested"]:
                continue
            self._start_attempt(job)

    def _start_attempt(self, job: dict[str, Any]) -> None:
        spec = JobSpec.from_dict(json.loads(job["spec"]))
        plan = Plan.from_dict(json.loads(job["plan"]))
        number = len(self.store.attempts(job["id"])) + 1
        workdir = Path(job["workdir"])
        attempt_dir = workdir / "attempts" / f"{number:03d}"
        config = AttemptConfig(
            job=spec,
            plan=plan,
            number=number,
            workdir=workdir,
            emulate_device_memory=job["emulate_device_memory"],
            # Only the job's first attempt measures: later ones have the history.
            probe=spec.ladder.probe and number == 1,
        )
        config.write(attempt_dir)
        newest = checkpoints.latest_valid(workdir / "checkpoints", warn=lambda text: self.event(job, "checkpoint", text))
        env = ladder.process_environment(plan, os.environ)
        with (attempt_dir / LOG).open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "oomguard.jobs.run", str(attempt_dir)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=workdir,
                # Its own session: a Ctrl-C or a signal to the daemon's group does not reach
                # it; the daemon decides when it stops (after a checkpoint).
                start_new_session=True,
            )
        now = time.time()
        with self.store.atomic():
            attempt_id = self.store.add_attempt(
                job_id=job["id"],
                number=number,
                plan=json.dumps(plan.to_dict()),
                rung=job["next_rung"],
                reason=job["next_reason"],
                directory=str(attempt_dir),
                pid=process.pid,
                started_at=now,
            )
            self.store.update_job(job["id"], state="running", started_at=job["started_at"] or now, next_rung=None, next_reason=None)
        self._running[attempt_id] = _Running(attempt_id, job["id"], process, process.pid)
        start = f"from the checkpoint at step {newest.step}" if newest else "from step 0 (no checkpoint yet)"
        self.event(job, "started", f"attempt {number} started with plan [{plan.short()}], resuming {start}")

    # Ending ---------------------------------------------------------------------------------

    def _adopt(self) -> None:
        """Take over the attempts an earlier daemon left running."""
        for attempt in self.store.running_attempts():
            self._running[attempt["id"]] = _Running(attempt["id"], attempt["job_id"], None, attempt["pid"])

    def _reap(self) -> None:
        for attempt_id, running in list(self._running.items()):
            attempt = self.store.db["attempts"].get(attempt_id)
            if running.process is not None:
                returncode = running.process.poll()
                if returncode is None:
                    self._enforce_stop_deadline(attempt)
                    self._report_live_recoveries(attempt)
                    continue
            else:
                if _process_alive(running.pid, attempt["directory"]):
                    self._enforce_stop_deadline(attempt)
                    self._report_live_recoveries(attempt)
                    continue
                returncode = None
            del self._running[attempt_id]
            self._finish_attempt(attempt, returncode)

    def _enforce_stop_deadline(self, attempt: dict[str, Any]) -> None:
        sent = attempt["term_sent_at"]
        if sent and time.time() - sent > STOP_GRACE_SECONDS:
            self._signal(attempt, signal.SIGKILL)

    def _signal(self, attempt: dict[str, Any], signum: int) -> None:
        try:
            os.killpg(attempt["pid"], signum)
        except ProcessLookupError:
            pass

    def _finish_attempt(self, attempt: dict[str, Any], returncode: int | None) -> None:
        job = self.store.job(attempt["job_id"])
        data = read_json(Path(attempt["directory"]) / OUTCOME)
        if data is not None:
            outcome = Outcome.from_dict(data)
        else:
            outcome = outcome_without_report(Path(attempt["directory"]), returncode)
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
        self._report_recoveries(attempt, list(outcome.recoveries))
        self.event(job, "attempt-ended", summary)
        self._next_step(job, outcome)

    def _next_step(self, job: dict[str, Any], outcome: Outcome) -> None:
        if outcome.kind == "finished":
            self._end_job(job, "finished", f"finished {outcome.step} steps; final model in {Path(job['workdir']) / 'final'}")
            return
        if job["cancel_requested"]:
            self._end_job(job, "cancelled", f"cancelled at step {outcome.step} (checkpoint kept in {job['workdir']})")
            return
        if outcome.kind == "interrupted" and self.stopping:
            self.store.update_job(job["id"], state="queued")
            self.event(job, "requeued", f"stopped with the daemon at step {outcome.step}; it resumes when the daemon starts again")
            return
        spec = JobSpec.from_dict(json.loads(job["spec"]))
        # The plan the attempt ended under: its probe or an in-process recovery may have
        # moved it from the one it started with.
        plan = outcome.plan or Plan.from_dict(json.loads(job["plan"]))
        history = [_past_attempt(a) for a in self.store.attempts(job["id"]) if a["outcome"]]
        decision = decide(outcome, plan, history, spec.policy())
        if isinstance(decision, Retry) and outcome.plan is not None:
            self.store.update_job(job["id"], plan=json.dumps(outcome.plan.to_dict()))
        if isinstance(decision, NextPlan):
            self.store.update_job(
                job["id"], state="queued", plan=json.dumps(decision.plan.to_dict()), next_rung=decision.rung, next_reason=decision.reason
            )
            self.event(job, "escalated", f"rung {decision.rung}: {decision.reason}")
        elif isinstance(decision, Retry):
            self.store.update_job(job["id"], state="queued", next_rung=None, next_reason=decision.reason)
            self.event(job, "retry", decision.reason)
        elif isinstance(decision, GiveUp):
            self._end_job(job, "failed", decision.reason, report=decision.report)

    def _report_live_recoveries(self, attempt: dict[str, Any]) -> None:
        heartbeat = read_json(Path(attempt["directory"]) / HEARTBEAT) or {}
        self._report_recoveries(attempt, heartbeat.get("recoveries") or [])

    def _report_recoveries(self, attempt: dict[str, Any], changes: list[dict[str, Any]]) -> None:
        """Rungs the runner took itself (probe, in-process) are events like the daemon's, each
        reported once: while the attempt runs, or when it ends."""
        reported = attempt["recoveries_reported"] or 0
        if len(changes) <= reported:
            return
        job = self.store.job(attempt["job_id"])
        for change in changes[reported:]:
            old, new = Plan.from_dict(change["from"]), Plan.from_dict(change["to"])
            self.event(job, "escalated", f"at step {change['step']}, in the runner: [{old.short()}] -> [{new.short()}]: {change['reason']}")
        self.store.update_attempt(attempt["id"], recoveries_reported=len(changes))
        attempt["recoveries_reported"] = len(changes)

    def _end_job(self, job: dict[str, Any], state: str, result: str, report: str | None = None) -> None:
        self.store.update_job(job["id"], state=state, ended_at=time.time(), result=result, report=report)
        self.event(job, state, result + (f"\n{report}" if report else ""))

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
