"""What starts next: the scheduling pass over the queue (priority, then first come first
served; --max-parallel slots; placement on GPUs with room), run once per tick by the supervisor.

The decisions come from ``schedule``, a pure function from what a pass sees (the queue, the
running attempts, the GPUs and who holds them) to what to do: start a job on a Placement, let
it wait for a GPU (and why), or stop at a full set of slots. The Scheduler gathers what it
sees, keeps what a pass over 10,000 queued jobs must not recompute (parsed job files, each
job's need, the last pass's view) and applies the decisions: attempts started through
Attempts, notes written through the lifecycle.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from oomguard.daemon.attempts import Running, handle_of, owner_uid
from oomguard.daemon.clock import Clock
from oomguard.daemon.disk_wait import DISK_CHECK_SECONDS, DiskWait, disk_wait_of, free_for
from oomguard.daemon.events import Events
from oomguard.daemon.launch import Launcher
from oomguard.daemon.lifecycle import Lifecycle
from oomguard.daemon.monitor import GpuMonitor
from oomguard.daemon.placement import Holder, Need, Placed, Placement, Waiting, place
from oomguard.daemon.store import Store
from oomguard.daemon.store_rows import AttemptRow, JobRow
from oomguard.jobs.device import DeviceSpec
from oomguard.jobs.spec import JobSpec
from oomguard.strategies.memory_model import MARGIN_RAN
from oomguard.strategies.units import format_duration_words

# The scheduling pass: skipped while nothing changes, but run in full at least this often;
# and at most this long per tick (a huge queue is gone through over several ticks, so that
# attempts are still collected and systemd's watchdog still hears from the daemon).
FULL_PASS_SECONDS = 60.0
PASS_SECONDS = 1.0
# How a queued job's note begins while it waits only for a slot (status' note column).
SLOTS_TAKEN = "queued behind running job(s) "


class JobCache:
    """Job files parsed once (a job's file never changes once it is queued), and each job's
    need, computed again only after one of its attempts started or ended."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._specs: dict[int, JobSpec] = {}
        self._needs: dict[int, tuple[tuple[str, int | None], Need]] = {}

    def spec(self, job: JobRow) -> JobSpec:
        spec = self._specs.get(job.id)
        if spec is None:
            spec = self._specs[job.id] = job.spec
        return spec

    def need(self, job: JobRow) -> Need:
        """What the job needs free per GPU (measure_need), kept while its plan and wait stay
        (the plan's stored text: comparing it costs nothing, parsing it at every pass would)."""
        cached = self._needs.get(job.id)
        if cached is not None and cached[0] == (job.plan_json, job.wait_free_bytes):
            return cached[1]
        need = measure_need(job, self.spec(job), self.store.attempts(job.id) if job.wait_free_bytes is None else [])
        self._needs[job.id] = ((job.plan_json, job.wait_free_bytes), need)
        return need

    def forget_need(self, job_id: int) -> None:
        self._needs.pop(job_id, None)

    def forget(self, job_id: int) -> None:
        """An ended job: nothing of it is needed again."""
        self._specs.pop(job_id, None)
        self._needs.pop(job_id, None)


class Scheduler:
    def __init__(
        self, store: Store, clock: Clock, launcher: Launcher, lifecycle: Lifecycle, events: Events, jobs: JobCache, *,
        gpus: GpuMonitor | None, max_parallel: int | None, stall_seconds: float, running: Mapping[int, Running],
        start: Callable[[JobRow, Placement], bool], device: DeviceSpec, disk_free: Callable[[DiskWait], int | None] = free_for,
    ) -> None:
        self.store = store
        self.clock = clock
        self.launcher = launcher
        self.lifecycle = lifecycle
        self.events = events
        self.jobs = jobs
        self.gpus = gpus
        # Without GPUs to place by, attempts run max_parallel at a time (default 1); with
        # GPUs, placement decides, within max_parallel when one is given.
        self.max_parallel = max_parallel
        self.stall_seconds = stall_seconds
        self.running = running  # the attempts running now (the Attempts' own record)
        self.start = start  # starts a job's next attempt where it was placed; False if it could not
        # The device each placed attempt trains on (the daemon's --emulate-device-memory, or
        # the real card): part of its Placement, never of the job's record.
        self.device = device
        # Jobs retried after a crash start no earlier than this (clock.monotonic(); forgotten
        # by a restarted daemon, which retries at once).
        self.not_before: dict[int, float] = {}
        self._last_pass: tuple[Any, ...] | None = None
        self._last_pass_at = 0.0
        self._slots_noted: tuple[str, tuple[int, ...]] | None = None
        # The room there is for a disk wait (os.statvfs, or what a folder leaves of a budget; a
        # test's fake), and when the jobs waiting for disk space were last looked at (None: not
        # yet, so at the first pass).
        self.disk_free = disk_free
        self._disk_checked_at: float | None = None

    def run_pass(self) -> None:
        """One scheduling pass: the decisions of ``schedule`` over what the store and the GPUs
        hold now, applied in order (an attempt started, a waiting job's note written)."""
        limit = slot_limit(self.max_parallel, self.gpus is not None)
        slots_full = limit is not None and len(self.running) >= limit
        # What the GPUs hold is read once per pass: the pass itself counts what it starts.
        gpus = self.gpus.read() if self.gpus is not None and not slots_full else None
        # Nothing changed since the last pass (no job or attempt written, the same attempts
        # running, the GPUs' free memory within 1/256 of each card): its answers stand, and the
        # queue is not even read. A full pass still runs every FULL_PASS_SECONDS, for what time
        # changes (a job waiting too long), and when a paused retry is due.
        now = self.clock.monotonic()
        self._check_disks(now)
        seen = pass_signature(self.store.job_writes, self.running, gpus, slots_full)
        due = any(when <= now for when in self.not_before.values())
        # A retry whose pause is over is an ordinary queued job again.
        self.not_before = {job_id: when for job_id, when in self.not_before.items() if when > now}
        if seen == self._last_pass and not due and now - self._last_pass_at < min(FULL_PASS_SECONDS, self.stall_seconds):
            return
        self._last_pass_at = now
        # A pass's own writes (the notes of waiting jobs) are its answers, not a change to
        # answer: unless it started an attempt (or ran out of time), the next tick sees what
        # it left. Otherwise the next tick passes again.
        done = self._pass(limit, slots_full, gpus)
        after = pass_signature(self.store.job_writes, self.running, gpus, slots_full)
        self._last_pass = None if not done else after if after[1:] == seen[1:] else seen

    def _pass(self, limit: int | None, slots_full: bool, gpus: list[Any] | None) -> bool:
        """The pass itself: False when it ran out of time (the rest of the queue next tick)."""
        queued = self.store.queued_jobs()
        if not queued:
            return True
        if slots_full:
            self._note_slots_taken(limit, queued)  # type: ignore[arg-type] - slots are full only under a limit
            return True
        # A job waiting for disk space is passed over until _check_disks finds room for it.
        waiting_for_disk = {job.id for job in queued if job.disk_path is not None}
        decisions = schedule(
            queued, running=len(self.running), limit=limit, gpus=gpus, holders=self._holders(gpus) if gpus is not None else {},
            need_of=self.jobs.need, paused=frozenset(self.not_before) | waiting_for_disk,
        )
        # The pass is bounded from here (reading the GPUs' holders is not part of it), and it
        # always applies its first decision.
        deadline = self.clock.monotonic() + PASS_SECONDS
        took: bool | None = None  # whether the last Start took: schedule() counts only those
        while True:
            try:
                decision = decisions.send(took)
            except StopIteration:
                return True
            took = self._apply(decision, limit, queued)
            if self.clock.monotonic() > deadline:
                return False

    def _check_disks(self, now: float) -> None:
        """Every DISK_CHECK_SECONDS: the jobs waiting for disk space (only they are read, through
        a partial index) that have room now go back to the queue as ordinary jobs. That write
        moves Store.job_writes, so the pass that follows starts them, without reading the whole
        queue at every tick while they wait."""
        if self._disk_checked_at is not None and now - self._disk_checked_at < DISK_CHECK_SECONDS:
            return
        self._disk_checked_at = now
        measured: dict[tuple[str, int | None], int | None] = {}
        for job in self.store.disk_waiting_jobs():
            try:
                wait = disk_wait_of(job)
                if wait is None:  # a half-written wait (an older oomguard's): nothing to wait for
                    self.lifecycle.disk_space_back(job, None)
                    continue
                where = (wait.path, wait.budget)
                if where not in measured:
                    measured[where] = self.disk_free(wait)
                if wait.has_room(measured[where]):
                    self.lifecycle.disk_space_back(job, measured[where])
            except Exception as error:  # noqa: BLE001 - one job's problem must not stop the queue
                self.lifecycle.failed_on(job.id, "looking at the disk space it waits for", error)

    def _apply(self, decision: Decision, limit: int | None, queued: list[JobRow]) -> bool | None:
        """Carry out one decision; for a Start, whether the attempt started. One job's problem
        must not stop the queue: an error is recorded against that job (Lifecycle.failed_on)."""
        if isinstance(decision, SlotsFull):
            self._note_slots_taken(limit, queued)  # type: ignore[arg-type] - slots are full only under a limit
            return None
        job = decision.job
        if isinstance(decision, Unschedulable):
            self.lifecycle.failed_on(job.id, "working out where it can run", decision.error)
            return None
        try:
            if isinstance(decision, WaitForGpu):
                # Lower-priority jobs may still fit elsewhere: the pass looks at them too. The
                # reason is an event when it changes in words, not with every byte of free memory.
                reason = decision.waiting.reason
                if job.waiting is None or not same_reason(job.waiting, reason):
                    self.lifecycle.note_waiting(job, reason, code=decision.waiting.code)
                self._check_waiting_too_long(job, reason)
                return None
            return self.start(job, Placement(decision.gpus, self.device))
        except Exception as error:  # noqa: BLE001 - one job's problem must not stop the queue
            self.lifecycle.failed_on(job.id, "starting an attempt", error)
            return False

    def _note_slots_taken(self, limit: int, queued: list[JobRow]) -> None:
        """Queued jobs that wait only for a slot say so, and for which jobs (status' note);
        written when the note or the queue changed, not at every tick."""
        running = ", ".join(str(job_id) for job_id in sorted(r.job_id for r in self.running.values()))
        why = f"--max-parallel {limit}" if self.max_parallel is not None else "without GPUs the daemon runs one at a time; --max-parallel raises it"
        note = f"{SLOTS_TAKEN}{running} ({why})"
        noted = (note, tuple(job.id for job in queued))
        if noted != self._slots_noted:
            self.lifecycle.note_slots_taken(note, replaces=SLOTS_TAKEN)
            self._slots_noted = noted

    def _check_waiting_too_long(self, job: JobRow, reason: str) -> None:
        """A job that has waited for a GPU as long as a silent attempt would be stalled is
        reported the same way, once per wait: someone may have to free a GPU."""
        since = job.waiting_since
        if since is None or self.clock.time() - since < self.stall_seconds or self.store.has_event_since(job.id, "stalled", since):
            return
        waited = self.clock.time() - since
        self.events.event(
            job, "stalled", f"queued and waiting for {format_duration_words(waited)}: {reason}", code="waiting_too_long", data={"seconds": waited},
            next_step="oomguard keeps waiting and starts it as soon as a GPU has room; free one (`oomguard gpus` shows what is on them), or cancel it",
        )

    def gpus_to_widen_onto(self, job: JobRow) -> int:
        """How many GPUs the job could run on now if it widened: those no other attempt holds
        and no process uses (its own, its attempt having ended, among them). 0 without a view
        of the GPUs."""
        if self.gpus is None:
            return 0
        states = self.gpus.read()
        holders = self._holders(states)
        return sum(1 for gpu in states if not gpu.processes and all(h.job_id == job.id for h in holders.get(gpu.index, [])))

    def _holders(self, gpus: list[Any]) -> dict[int, list[Holder]]:
        holders: dict[int, list[Holder]] = {}
        placed = [(attempt, self.store.job(attempt.job_id)) for attempt in self.store.running_attempts() if attempt.gpus]
        # Which attempt each process on a GPU belongs to (the launcher knows its processes).
        pids = {p.pid for g in gpus for p in g.processes}
        theirs = self.launcher.processes_of([(handle_of(attempt), owner_uid(job)) for attempt, job in placed], pids)
        for attempt, job in placed:
            spec = self.jobs.spec(job)
            need = self.jobs.need(job)
            mine = theirs.get(attempt.directory, set())
            for index in attempt.gpus or ():
                used = sum(p.used_bytes for g in gpus if g.index == index for p in g.processes if p.pid in mine)
                holders.setdefault(index, []).append(Holder(job.id, spec.resources.share, need.free_bytes, used))
        return holders


# The decisions, as pure functions --------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """Start the job's next attempt on these GPUs (None: the daemon places none)."""

    job: JobRow
    gpus: tuple[int, ...] | None


@dataclass(frozen=True)
class WaitForGpu:
    """The job stays queued: no GPU has room for it now (placement says why). A job that can
    never fit (more GPUs than the box has) waits like any other, saying so, and is reported
    stalled after --stall-after: a card may only be lost for a while."""

    job: JobRow
    waiting: Waiting


@dataclass(frozen=True)
class SlotsFull:
    """Every slot is taken: the rest of the queue waits for one (the pass ends here)."""


@dataclass(frozen=True)
class Unschedulable:
    """What the job needs could not be worked out (its stored record does not read): the
    error, for the caller to record against the job, while the pass goes on."""

    job: JobRow
    error: Exception


Decision = Union[Start, WaitForGpu, SlotsFull, Unschedulable]


def schedule(
    queued: Sequence[JobRow], *, running: int, limit: int | None, gpus: list[Any] | None, holders: Mapping[int, list[Holder]],
    need_of: Callable[[JobRow], Need], paused: frozenset[int] = frozenset(),
) -> Iterator[Decision]:
    """What to do with each queued job, in queue order: the jobs that fit start, the others
    wait (a lower-priority job may still fit where a higher one does not), until the slots are
    full. ``running`` attempts run already; ``holders`` are the attempts on each GPU; ``paused``
    jobs wait out a retry's pause and are passed over; jobs being cancelled too. Each job
    started here counts at once: it takes a slot, and holds its need (what it waits for free,
    after contention) on its GPUs for the jobs after it, as the running attempts do. The
    caller sends back whether each Start took (``send(False)``: it failed, and took nothing);
    iterated plainly, every Start counts. Lazy, so that a caller can stop part-way (a pass is
    bounded in time); jobs with the same need get the same answer until one starts."""
    holding = {index: list(on_gpu) for index, on_gpu in holders.items()}
    answers: dict[Need, Placed | Waiting] = {}
    for job in queued:
        if limit is not None and running >= limit:
            yield SlotsFull()
            return
        if job.cancel_requested or job.id in paused:
            continue
        placed: Placed | None = None  # without GPUs to place by, a job starts where it is
        if gpus is not None:
            try:
                need = need_of(job)
                if need not in answers:
                    answers[need] = place(need, gpus, holding)
            except Exception as error:  # noqa: BLE001 - a job whose record does not read must not stop the queue
                yield Unschedulable(job, error)
                continue
            where = answers[need]
            if isinstance(where, Waiting):
                yield WaitForGpu(job, where)
                continue
            placed = where
        took = yield Start(job, placed.gpus if placed is not None else None)
        if took is False:
            continue
        running += 1
        if placed is not None:
            for index in placed.gpus:
                holding.setdefault(index, []).append(Holder(job.id, need.share, need.free_bytes, used_bytes=0))
            answers.clear()


def slot_limit(max_parallel: int | None, has_gpus: bool) -> int | None:
    """How many attempts may run at once (None: as many as placement allows)."""
    return max_parallel if max_parallel is not None else (None if has_gpus else 1)


def pass_signature(job_writes: int, running: Mapping[int, Any], gpus: list[Any] | None, slots_full: bool) -> tuple[Any, ...]:
    """What a pass sees, without reading the queue: how many writes the store has made to jobs
    and attempts (Store.job_writes: a queue that changed in any way moved it), the attempts
    running, the GPUs' free memory within 1/256 of each card, and whether the slots are full.
    A pass that would see what the last one saw answers the same."""
    return (
        job_writes,
        tuple(sorted(running)),
        tuple((g.index, g.free * 256 // max(g.total, 1), len(g.processes)) for g in gpus) if gpus is not None else None,
        slots_full,
    )


def measure_need(job: JobRow, spec: JobSpec, attempts: list[AttemptRow]) -> Need:
    """What the job needs free per GPU: after contention, what it waits for; else the peak
    its plan measured (with the margin of a plan that ran); else what the job file says."""
    free_bytes: int | None = job.wait_free_bytes
    if free_bytes is None:
        plan = job.plan
        peaks = [
            m.held_bytes
            for attempt in attempts
            if attempt.outcome is not None
            for m in attempt.outcome.measurements
            if m.fits and m.plan == plan
        ]
        free_bytes = int(max(peaks) * (1 + MARGIN_RAN)) if peaks else spec.resources.memory
    # A built-in job runs one process per GPU: as many GPUs as its plan has processes (more than
    # resources.gpus once it widened).
    gpus = job.plan.world_size if spec.command is None else spec.resources.gpus
    return Need(gpus=gpus, share=spec.resources.share, free_bytes=free_bytes)


def same_reason(old: str, new: str) -> bool:
    """The same reason to wait in words (numbers aside: not an event per byte of free memory)."""
    return re.sub(r"[0-9.]+", "#", old) == re.sub(r"[0-9.]+", "#", new)
