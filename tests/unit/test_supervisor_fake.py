"""The supervisor's loop with a fake Launcher and Clock (tests/fakes.py): what starts, in which
order, and what a job does after each way an attempt can end. Supervisor.drain() runs the loop
synchronously; nothing sleeps and no process starts (tests/unit/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from oomguard.daemon.launch import LaunchRequest, QueueState
from oomguard.daemon.launch.slurm_text import queue_state
from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store
from oomguard.daemon.supervisor import SLOTS_TAKEN, STALL_SECONDS, STOP_GRACE_SECONDS, Supervisor
from oomguard.daemon.users import Account
from oomguard.strategies import doctor
from oomguard.strategies.outcome import MemoryFigures, Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.errors import LaunchFailed
from tests.fakes import FakeClock, FakeLauncher
from tests.jobs_helpers import tiny_job

MiB = 2**20
OOM = Outcome(
    kind="oom", step=2, phase="backward", message="CUDA out of memory.",
    memory=MemoryFigures(requested=64 * MiB, allocated=900 * MiB, free=0, total=1024 * MiB, breakdown={"activations": 700 * MiB}),
)
CRASH = Outcome(kind="crashed", step=0, message="ValueError: boom", traceback_tail="Traceback ...\nValueError: boom\n")


@dataclass
class Box:
    state: StateDir
    store: Store
    clock: FakeClock
    launcher: FakeLauncher

    def supervisor(self, **options: Any) -> Supervisor:
        return Supervisor(self.state, self.store, launcher=self.launcher, clock=self.clock, **options)

    def kinds(self, job_id: int) -> list[str]:
        return [event.kind for event in self.store.events(job_id)]

    def last_event(self, job_id: int) -> tuple[str, str | None, dict[str, Any]]:
        """The job's newest event: its kind, code and figures (what tests read, not its words)."""
        event = self.store.events(job_id)[-1]
        return event.kind, event.code, event.data

    def plan_of(self, request: LaunchRequest) -> Plan:
        return Plan.from_dict(json.loads(request.stdin)["plan"])


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    clock = FakeClock()
    state = StateDir(tmp_path / "state").create()
    store = Store(state.database, now=clock.time)
    yield Box(state, store, clock, FakeLauncher())
    store.close()


def add(supervisor: Supervisor, name: str, priority: int = 0) -> int:
    spec = tiny_job(name)
    return supervisor.add_job(spec.__class__.parse({**spec.to_dict(), "priority": priority}), Account.current())


def test_the_highest_priority_starts_first_then_first_come_first_served(box: Box) -> None:
    supervisor = box.supervisor()
    first, urgent, second = add(supervisor, "first"), add(supervisor, "urgent", priority=5), add(supervisor, "second")
    order = []
    for _ in range(3):
        supervisor.drain()
        (request,) = [r for r in box.launcher.started if str(r.attempt_dir) in box.launcher.running_folders()]
        order.append(request.attempt_dir.parent.parent.name)
        box.launcher.finish(request, Outcome(kind="finished", step=8))
    supervisor.drain()
    assert order == [str(urgent), str(first), str(second)]
    assert all(box.store.job(job_id).state == "finished" for job_id in (first, urgent, second))
    assert box.last_event(first) == ("finished", "finished", {"step": 8})


def test_no_more_than_max_parallel_run_and_the_others_say_why(box: Box) -> None:
    supervisor = box.supervisor(max_parallel=2)
    jobs = [add(supervisor, f"j{n}") for n in range(3)]
    supervisor.drain()
    assert len(box.launcher.started) == 2 and supervisor.active()
    waiting = box.store.job(jobs[2])
    assert waiting.state == "queued"
    assert waiting.waiting == f"{SLOTS_TAKEN}{jobs[0]}, {jobs[1]} (--max-parallel 2)"
    box.launcher.finish(box.launcher.started[0], Outcome(kind="finished", step=8))
    supervisor.drain()
    assert len(box.launcher.started) == 3 and box.store.job(jobs[2]).state == "running"


def test_an_oom_queues_the_next_plan_with_an_escalation_event(box: Box) -> None:
    supervisor = box.supervisor()
    job_id = add(supervisor, "big")
    supervisor.drain()
    box.launcher.finish(box.launcher.started[0], OOM, returncode=1)
    supervisor.drain(until=lambda: len(box.launcher.started) == 2)
    assert box.kinds(job_id) == ["queued", "started", "attempt-ended", "escalated", "started"]
    escalated = next(e for e in box.store.events(job_id) if e.kind == "escalated")
    first, second = (box.plan_of(request) for request in box.launcher.started)
    assert second != first and escalated.code == "ladder"
    assert escalated.data == {"rung": escalated.data["rung"], "from": first.short(), "to": second.short()}
    attempts = box.store.attempts(job_id)
    assert attempts[0].outcome_kind == "oom" and attempts[1].rung == escalated.data["rung"]
    ended = next(e for e in box.store.events(job_id) if e.kind == "attempt-ended")
    assert (ended.code, ended.data) == ("oom", {"attempt": 1, "step": 2, "phase": "backward", "resumed_from": None})


def test_a_crash_that_repeats_itself_fails_the_job(box: Box) -> None:
    supervisor = box.supervisor()
    job_id = add(supervisor, "crashy")
    supervisor.drain()
    box.launcher.finish(box.launcher.started[0], CRASH, returncode=1)
    supervisor.drain()
    job = box.store.job(job_id)
    assert job.state == "queued" and box.last_event(job_id) == ("retry", "retry", {"after_seconds": doctor.CRASH_BACKOFF_SECONDS})
    assert len(box.launcher.started) == 1  # the retry waits for its pause
    box.clock.advance(doctor.CRASH_BACKOFF_SECONDS)
    supervisor.drain()
    assert len(box.launcher.started) == 2
    box.launcher.finish(box.launcher.started[1], CRASH, returncode=1)
    supervisor.drain()
    job = box.store.job(job_id)
    assert job.state == "failed" and job.ended_at == box.clock.time()
    assert box.last_event(job_id) == ("failed", "gave_up", {"outcome": "crashed", "step": 0})
    # A message test on purpose: the sentence a user reads when a job gives up.
    assert job.result == "the attempt crashed twice in a row at step 0 with the same error: ValueError: boom"


def test_a_queued_job_is_cancelled_before_it_starts(box: Box) -> None:
    supervisor = box.supervisor()
    job_id = add(supervisor, "never")
    box.store.request_cancel(job_id)
    supervisor.drain()
    assert box.store.job(job_id).state == "cancelled" and box.last_event(job_id) == ("cancelled", "cancelled_queued", {})
    assert box.launcher.started == []


def test_a_running_job_is_asked_to_stop_then_killed_after_the_grace_period(box: Box) -> None:
    supervisor = box.supervisor()
    job_id = add(supervisor, "long")
    supervisor.drain()
    (request,) = box.launcher.started
    box.store.request_cancel(job_id)
    supervisor.drain()
    assert box.launcher.stops == [(str(request.attempt_dir), False)] and box.last_event(job_id) == ("cancelling", "cancelling", {"attempt": 1})
    box.clock.advance(STOP_GRACE_SECONDS + 1)
    supervisor.drain()
    assert box.launcher.stops[-1] == (str(request.attempt_dir), True)
    box.launcher.finish(request, Outcome(kind="interrupted", step=3), returncode=-9)
    supervisor.drain()
    assert box.store.job(job_id).state == "cancelled" and box.last_event(job_id) == ("cancelled", "cancelled_running", {"step": 3})


def test_a_restarted_daemon_adopts_a_running_attempt_and_collects_it(box: Box) -> None:
    first = box.supervisor()
    job_id = add(first, "survivor")
    first.drain()
    (request,) = box.launcher.started
    pid = box.store.attempts(job_id)[0].pid
    again = box.supervisor()  # the same machine: the attempt still runs
    assert [(h.attempt_dir, h.pid) for h in box.launcher.adopted] == [(str(request.attempt_dir), pid)]
    again.drain()
    assert again.active() and box.store.job(job_id).state == "running" and len(box.launcher.started) == 1
    box.launcher.finish(request, Outcome(kind="finished", step=8))
    again.drain()
    assert box.store.job(job_id).state == "finished"


def test_an_attempt_that_never_started_is_interrupted_and_queued_again(box: Box) -> None:
    first = box.supervisor()
    job_id = add(first, "early")
    first.drain()
    (request,) = box.launcher.started
    # The daemon died after recording the attempt and before its process started.
    box.store.update_attempt(box.store.attempts(job_id)[0].id, pid=None, pid_started=None)
    box.launcher.lose(request)
    again = box.supervisor()
    again.stopping = True  # collect only
    again.drain()
    (attempt,) = box.store.attempts(job_id)
    assert attempt.outcome_kind == "interrupted" and box.store.job(job_id).state == "queued"


def test_an_attempt_that_cannot_be_launched_fails_its_job_saying_how_to_fix_it(box: Box) -> None:
    box.launcher.fail_with = LaunchFailed("cannot start the attempt's shim (python) as me: Permission denied", "let me run python")
    supervisor = box.supervisor()
    job_id = add(supervisor, "unlucky")
    supervisor.drain()
    job = box.store.job(job_id)
    assert job.state == "failed" and box.last_event(job_id) == ("failed", "spawn_failed", {"attempt": 1})
    # A message test on purpose: the launcher's own words reach the job's result as they are.
    assert job.result == "cannot start the attempt's shim (python) as me: Permission denied"
    assert box.store.attempts(job_id)[0].outcome_kind == "crashed"


def test_a_launch_that_may_work_later_waits_and_starts_again_without_using_a_try(box: Box) -> None:
    box.launcher.fail_with = LaunchFailed("sbatch could not submit it now: Unable to contact slurm controller", "nothing", retry_after=60.0)
    box.launcher.failures_left = 1
    supervisor = box.supervisor()
    job_id = add(supervisor, "patient")
    supervisor.drain()
    job = box.store.job(job_id)
    assert job.state == "queued" and job.waiting is not None and "trying again in 60 s" in job.waiting
    assert [a.outcome_kind for a in box.store.attempts(job_id)] == ["interrupted"]
    assert box.launcher.started == []  # not again before the pause is over
    box.clock.advance(61)
    supervisor.drain()
    assert box.store.job(job_id).state == "running" and len(box.launcher.started) == 1


def on_a_cluster(box: Box, name: str, state: QueueState) -> tuple[Supervisor, int, str]:
    """A job whose attempt started, and a batch scheduler that has it in ``state``: the
    supervisor, the job and the attempt's folder."""
    supervisor = box.supervisor()
    job_id = add(supervisor, name)
    supervisor.drain()
    (request,) = box.launcher.started
    folder = str(request.attempt_dir)
    box.launcher.queue[folder] = state
    supervisor.drain()
    return supervisor, job_id, folder


def test_a_pending_attempt_the_cluster_will_never_start_is_cancelled_and_its_job_fails_naming_the_fix(box: Box) -> None:
    supervisor, job_id, folder = on_a_cluster(box, "too-long", QueueState("PENDING", "Priority", 0))
    assert box.store.attempts(job_id)[0].scheduler_reason == "Priority"  # status shows why it waits
    box.launcher.queue[folder] = queue_state("PENDING", "PartitionTimeLimit", 0)  # as the Slurm launcher reads it
    supervisor.drain()
    job = box.store.job(job_id)
    assert job.state == "failed" and box.last_event(job_id)[:2] == ("failed", "never_starts")
    assert "lower resources.time_limit or slurm.time_limit" in (job.result or "")
    assert (folder, True) in box.launcher.stops


def test_a_requeue_by_the_cluster_is_an_event_and_the_same_attempt_goes_on(box: Box) -> None:
    supervisor, job_id, _ = on_a_cluster(box, "requeued", QueueState("PENDING", "BeginTime", 1))
    assert box.last_event(job_id)[:2] == ("requeued", "scheduler_requeued")
    assert box.store.job(job_id).state == "running" and len(box.launcher.started) == 1


def test_a_job_that_cannot_start_leaves_its_slot_to_the_next_in_the_same_pass(box: Box) -> None:
    box.launcher.fail_with = LaunchFailed("cannot start the attempt's shim (python) as me: Permission denied", "let me run python")
    box.launcher.failures_left = 1
    supervisor = box.supervisor()
    unlucky, next_one = add(supervisor, "unlucky"), add(supervisor, "next")
    supervisor.tick()  # one pass: one slot (no GPUs), and the failed start did not take it
    assert box.store.job(unlucky).state == "failed" and box.store.job(next_one).state == "running"
    assert box.store.job(next_one).waiting is None  # never told it waits behind a job that is not running


def test_a_job_whose_stored_record_does_not_read_fails_alone(box: Box) -> None:
    supervisor = box.supervisor()
    broken, fine = add(supervisor, "broken"), add(supervisor, "fine")
    box.store.update_job(broken, spec="{}")  # written by another oomguard, say: no table the job needs
    supervisor.tick()  # does not raise: the daemon goes on
    assert box.store.job(broken).state == "failed" and box.store.job(fine).state == "running"


def test_a_silent_attempt_is_reported_stalled_once(box: Box) -> None:
    supervisor = box.supervisor()
    job_id = add(supervisor, "quiet")
    supervisor.drain()
    box.clock.advance(STALL_SECONDS + 1)
    supervisor.drain()
    supervisor.drain()
    assert box.kinds(job_id).count("stalled") == 1
    kind, code, data = box.last_event(job_id)
    assert (kind, code, data["attempt"]) == ("stalled", "no_heartbeat", 1) and data["seconds"] > STALL_SECONDS


def test_an_attempt_that_waited_in_a_clusters_queue_is_not_stalled_when_it_starts_running(box: Box) -> None:
    supervisor, job_id, folder = on_a_cluster(box, "queued-long", QueueState("PENDING", "Priority", 0))
    box.clock.advance(STALL_SECONDS * 3)  # hours in the cluster's queue: not a stall
    supervisor.drain()
    box.launcher.queue[folder] = QueueState("RUNNING", None, 0)
    supervisor.drain()
    assert "stalled" not in box.kinds(job_id)
    box.clock.advance(STALL_SECONDS + 1)  # silent that long once running: a stall
    supervisor.drain()
    assert box.kinds(job_id).count("stalled") == 1


def test_attempts_stopped_with_the_daemon_go_back_to_the_queue(box: Box) -> None:
    supervisor = box.supervisor()
    job_id = add(supervisor, "paused")
    supervisor.drain()
    (request,) = box.launcher.started
    supervisor.stop_all()
    assert box.launcher.stops == [(str(request.attempt_dir), False)] and not supervisor.stopped()
    box.launcher.finish(request, Outcome(kind="interrupted", step=4), returncode=0)
    supervisor.drain()
    assert supervisor.stopped() and box.store.job(job_id).state == "queued"
    assert box.last_event(job_id) == ("requeued", "daemon_stopped", {"step": 4}) and len(box.launcher.started) == 1  # nothing starts while stopping


def test_a_daemon_that_leaves_leaves_its_attempts_running(box: Box) -> None:
    supervisor = box.supervisor()
    job_id = add(supervisor, "left")
    supervisor.drain()
    supervisor.leave_all()
    assert supervisor.stopped() and box.launcher.stops == [] and box.store.job(job_id).state == "running"


def test_an_idle_daemon_does_not_read_the_queue_until_something_changes(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue of 10,000 jobs read at every tick took a fifth of a core while nothing happened."""
    supervisor = box.supervisor(max_parallel=1)
    for n in range(5):
        add(supervisor, f"j{n}")
    supervisor.drain()
    reads = []
    queued_jobs = box.store.queued_jobs
    monkeypatch.setattr(box.store, "queued_jobs", lambda: reads.append(1) or queued_jobs())
    for _ in range(20):
        box.clock.advance(0.5)
        supervisor.tick()
    assert reads == []
    add(supervisor, "late")  # a new job is a change: the next tick reads the queue once
    for _ in range(3):
        supervisor.tick()
    assert len(reads) == 1
    box.clock.advance(61)  # and a full pass runs at least once a minute, for what time changes
    supervisor.tick()
    assert len(reads) == 2


def test_the_daemon_forgets_ended_jobs_after_forget_after_checking_hourly(box: Box) -> None:
    day = 86400.0
    supervisor = box.supervisor(forget_after_seconds=30 * day)
    done, waiting = add(supervisor, "done"), add(supervisor, "waiting")
    supervisor.drain()
    (request,) = box.launcher.started
    box.launcher.finish(request, Outcome(kind="finished", step=8))
    supervisor.drain()
    assert box.store.job(done).state == "finished"
    box.clock.advance(29 * day)
    supervisor.drain()
    assert [job.id for job in box.store.jobs()] == [done, waiting]  # not old enough yet
    box.clock.advance(2 * day)
    supervisor.tick()
    assert [job.id for job in box.store.jobs()] == [waiting]


def test_a_step_back_up_in_the_runner_is_an_event_of_its_own_and_its_failure_an_escalation(box: Box) -> None:
    supervisor = box.supervisor()
    job_id = add(supervisor, "steps")
    supervisor.drain()
    (request,) = box.launcher.started
    full = box.plan_of(request)
    half = full.replace(micro_batch=full.micro_batch // 2)
    changes = (
        {"step": 5, "from": full.to_dict(), "to": half.to_dict(), "reason": "in-process -> [half]", "oom": "out of memory in forward at step 5"},
        {"step": 10, "from": half.to_dict(), "to": full.to_dict(), "reason": "stepped back up to [full]", "direction": "up"},
        {"step": 11, "from": full.to_dict(), "to": half.to_dict(), "reason": "the step back up did not hold", "oom": "out of memory", "direction": "back"},
    )
    box.launcher.finish(request, Outcome(kind="finished", step=8, recoveries=changes))
    supervisor.drain()
    runner_events = [(e.kind, e.code, e.data["step"]) for e in box.store.events(job_id) if e.code in ("in_runner", "step_up", "step_up_failed")]
    assert runner_events == [("escalated", "in_runner", 5), ("stepped-up", "step_up", 10), ("escalated", "step_up_failed", 11)]


COMMAND_JOB = """\
name = "script"
trainer = "command"
[command]
argv = ["python3", "train.py", "--train_batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum}"]
[train]
batch_size = 16
max_steps = 20
[ladder]
max_attempts = 2
"""


def test_a_command_job_steps_back_up_at_a_relaunch_and_back_when_it_does_not_hold(box: Box, tmp_path: Path) -> None:
    """The device has 80 MiB from step 5 to 9 (a neighbour); the script ran out of memory at 5
    and went on at micro-batch 8. Relaunched after a time limit at step 9, with the room back,
    it goes back to 16; that runs out of memory again (the neighbour came back): micro-batch 8,
    no try used (the job has two), and only the relaunch after that one steps up again."""
    from oomguard.jobs.device import DeviceSpec
    from oomguard.jobs.spec import parse_job_text
    from oomguard.strategies.memory_model import Measurement

    supervisor = box.supervisor(device=DeviceSpec.from_option("1000MiB,80MiB@5,1000MiB@9"))
    spec = parse_job_text(COMMAND_JOB, tmp_path / "script.toml", check_files=False)
    job_id = supervisor.add_job(spec, Account.current(), workdir=str(tmp_path / "work"))
    static = {"parameters": 8 * MiB, "trainable": 8 * MiB, "optimizer_state": 16 * MiB}

    def ran(plan: Plan, peak_mib: int) -> Measurement:
        return Measurement(plan=plan, fits=True, peak_bytes=peak_mib * MiB, capacity=1000 * MiB, samples_per_s=100.0, static=static)

    def out_of_memory(step: int, plan: Plan, *measured: Measurement) -> Outcome:
        figures = MemoryFigures(requested=4 * MiB, allocated=78 * MiB, free=0, total=80 * MiB, breakdown={"activations": 40 * MiB})
        return Outcome(kind="oom", step=step, phase="forward", memory=figures, measurements=(*measured, figures.measurement(plan, step)))

    def attempt() -> tuple[LaunchRequest, Plan]:
        supervisor.drain()
        request = box.launcher.started[-1]
        return request, box.plan_of(request)

    request, own = attempt()
    box.launcher.finish(request, out_of_memory(5, own, ran(own, 100)))
    request, half = attempt()
    assert half.micro_batch == 8 and "--train_batch_size=8" in request.argv
    box.launcher.finish(request, Outcome(kind="time_limit", step=9, resumed_from=5, measurements=(ran(half, 60),)))
    request, stepped = attempt()
    assert stepped == own and "--train_batch_size=16" in request.argv
    (up,) = [e for e in box.store.events(job_id) if e.code == "step_up"]
    assert up.kind == "stepped-up" and up.message.startswith("attempt 3: stepped back up to [mb=16x1]")
    box.launcher.finish(request, out_of_memory(11, own))
    request, back = attempt()
    assert back == half
    (failed,) = [e for e in box.store.events(job_id) if e.code == "step_up_failed"]
    assert "the step back up to [mb=16x1] did not hold -> back to [mb=8x2]" in failed.message
    box.launcher.finish(request, Outcome(kind="time_limit", step=13, resumed_from=11))
    request, again = attempt()
    assert again == own  # the way back was the relaunch it waited; this one has the room
    assert len([e for e in box.store.events(job_id) if e.code == "step_up"]) == 2
    assert box.store.job(job_id).state == "running"
