"""The scheduler's decisions as pure functions (daemon/scheduler.py): schedule() from what a
pass sees to what it does, and the helpers it is made of."""

from __future__ import annotations

import json
from types import SimpleNamespace

from oomguard.daemon.gpus import GpuState
from oomguard.daemon.placement import Holder, Need
from oomguard.daemon.scheduler import (
    SlotsFull, Start, Unschedulable, WaitForGpu, measure_need, pass_signature, same_reason, schedule, slot_limit,
)
from oomguard.strategies.memory_model import MARGIN_RAN, Measurement
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from tests.fakes import attempt_row, job_row
from tests.jobs_helpers import tiny_job


def test_without_gpus_one_runs_at_a_time_unless_max_parallel_says_otherwise() -> None:
    assert slot_limit(None, has_gpus=False) == 1
    assert slot_limit(None, has_gpus=True) is None  # placement decides
    assert slot_limit(3, has_gpus=True) == slot_limit(3, has_gpus=False) == 3


def test_a_pass_sees_the_same_thing_while_free_memory_moves_within_a_256th() -> None:
    gpu = SimpleNamespace(index=0, free=1000 * 2**20, total=2**30, processes=[])
    moved_a_little = SimpleNamespace(index=0, free=1000 * 2**20 + 2**20 // 2, total=2**30, processes=[])
    moved_a_lot = SimpleNamespace(index=0, free=500 * 2**20, total=2**30, processes=[])
    assert pass_signature(5, {}, [gpu], False) == pass_signature(5, {}, [moved_a_little], False)
    assert pass_signature(5, {}, [gpu], False) != pass_signature(5, {}, [moved_a_lot], False)
    assert pass_signature(5, {}, None, False) != pass_signature(5, {7: object()}, None, False)
    assert pass_signature(5, {}, None, False) != pass_signature(6, {}, None, False)  # a job or attempt written
    assert pass_signature(5, {}, None, False) != pass_signature(5, {}, None, True)


def test_a_job_needs_what_its_plan_measured_with_a_margin_else_what_its_file_says() -> None:
    spec = tiny_job()
    plan = spec.initial_plan()
    job = job_row(plan=json.dumps(plan.to_dict()))
    assert measure_need(job, spec, []) == Need(gpus=spec.resources.gpus, share=spec.resources.share, free_bytes=spec.resources.memory)
    ran = Outcome(kind="oom", measurements=(Measurement(plan=plan, peak_bytes=100 * 2**20, fits=True),))
    other = Outcome(kind="oom", measurements=(Measurement(plan=Plan.from_dict({**plan.to_dict(), "micro_batch": 1, "grad_accum": plan.batch_size}), peak_bytes=10**12, fits=True),))
    attempts = [attempt_row(outcome=json.dumps(ran.to_dict())), attempt_row(outcome=json.dumps(other.to_dict())), attempt_row(outcome=None)]
    assert measure_need(job, spec, attempts).free_bytes == int(100 * 2**20 * (1 + MARGIN_RAN))
    assert measure_need(job_row(plan=json.dumps(plan.to_dict()), wait_free_bytes=5), spec, attempts).free_bytes == 5  # after contention: what it waits for


def test_a_reason_to_wait_is_the_same_whatever_its_numbers() -> None:
    assert same_reason("GPU 0 has 4.0 MiB free of 64.0 MiB", "GPU 0 has 3.5 MiB free of 64.0 MiB")
    assert not same_reason("GPU 0 has 4.0 MiB free", "needs 2 GPUs")


MiB = 2**20


def _needs(**by_name: Need):
    return lambda job: by_name[job.name]


def _what(decisions) -> list[tuple]:
    """Decisions in a form a test can compare: (kind, job id, GPUs or the waiting code)."""
    shown: list[tuple] = []
    for decision in decisions:
        if isinstance(decision, Start):
            shown.append(("start", decision.job.id, decision.gpus))
        elif isinstance(decision, WaitForGpu):
            shown.append(("wait", decision.job.id, decision.waiting.code))
        elif isinstance(decision, Unschedulable):
            shown.append(("unschedulable", decision.job.id, type(decision.error).__name__))
        else:
            assert isinstance(decision, SlotsFull)
            shown.append(("slots full",))
    return shown


def _answering(decisions, took: dict[int, bool]) -> list[tuple]:
    """Drive schedule() as the Scheduler does: send back whether each Start took."""
    shown, answer = [], None
    while True:
        try:
            decision = decisions.send(answer)
        except StopIteration:
            return shown
        shown += _what([decision])
        answer = took.get(decision.job.id, True) if isinstance(decision, Start) else None


def test_a_job_that_does_not_fit_waits_and_a_later_one_that_fits_starts() -> None:
    queue = [job_row(id=1, name="big"), job_row(id=2, name="small")]
    gpus = [GpuState(index=0, name="t", total=64 * MiB, used=40 * MiB)]
    needs = _needs(big=Need(1, True, 50 * MiB), small=Need(1, True, 10 * MiB))
    decisions = list(schedule(queue, running=0, limit=None, gpus=gpus, holders={}, need_of=needs))
    assert _what(decisions) == [("wait", 1, "no_room"), ("start", 2, (0,))]
    assert "50.0 MiB" in decisions[0].waiting.reason  # placement's own words: what the job needs


def test_a_job_started_in_a_pass_holds_its_need_for_the_jobs_after_it() -> None:
    # Room for one of the two: the second must not be placed on memory the first is about to take.
    queue = [job_row(id=1, name="a"), job_row(id=2, name="b"), job_row(id=3, name="c")]
    gpus = [GpuState(index=0, name="t", total=64 * MiB, used=0), GpuState(index=1, name="t", total=64 * MiB, used=20 * MiB)]
    needs = _needs(a=Need(1, True, 40 * MiB), b=Need(1, True, 40 * MiB), c=Need(1, True, 20 * MiB))
    assert _what(schedule(queue, running=0, limit=None, gpus=gpus, holders={}, need_of=needs)) == [
        ("start", 1, (1,)),  # sharing jobs fill the fullest GPU that fits
        ("start", 2, (0,)),
        ("start", 3, (0,)),  # 64 - 40 promised to job 2 leaves 24
    ]
    held = {0: [Holder(9, share=True, need_bytes=50 * MiB, used_bytes=0)]}
    assert _what(schedule(queue[:1], running=1, limit=None, gpus=gpus[:1], holders=held, need_of=needs)) == [("wait", 1, "no_room")]


def test_an_exclusive_job_started_in_a_pass_keeps_the_gpu_to_itself() -> None:
    queue = [job_row(id=1, name="x"), job_row(id=2, name="y")]
    gpus = [GpuState(index=0, name="t", total=64 * MiB, used=0)]
    needs = _needs(x=Need(1, False, None), y=Need(1, False, None))
    assert _what(schedule(queue, running=0, limit=None, gpus=gpus, holders={}, need_of=needs)) == [("start", 1, (0,)), ("wait", 2, "no_room")]


def test_the_pass_ends_when_the_slots_are_full_and_passes_over_paused_and_cancelled_jobs() -> None:
    queue = [job_row(id=1, name="a", cancel_requested=1), job_row(id=2, name="b"), job_row(id=3, name="c"), job_row(id=4, name="d")]
    decisions = schedule(queue, running=1, limit=3, gpus=None, holders={}, need_of=_needs(), paused=frozenset({2}))
    assert _what(decisions) == [("start", 3, None), ("start", 4, None)]
    decisions = schedule(queue, running=1, limit=2, gpus=None, holders={}, need_of=_needs(), paused=frozenset({2}))
    assert _what(decisions) == [("start", 3, None), ("slots full",)]


def test_a_job_asking_for_more_gpus_than_the_box_has_waits_saying_so() -> None:
    queue = [job_row(id=1, name="wide")]
    gpus = [GpuState(index=0, name="t", total=64 * MiB, used=0)]
    decisions = schedule(queue, running=0, limit=None, gpus=gpus, holders={}, need_of=_needs(wide=Need(2, False, None)))
    assert _what(decisions) == [("wait", 1, "too_few_gpus")]


def test_a_start_that_failed_takes_neither_a_slot_nor_memory() -> None:
    queue = [job_row(id=1, name="a"), job_row(id=2, name="b")]
    assert _answering(schedule(queue, running=0, limit=1, gpus=None, holders={}, need_of=_needs()), {1: False}) == [
        ("start", 1, None), ("start", 2, None),
    ]
    assert _answering(schedule(queue, running=0, limit=1, gpus=None, holders={}, need_of=_needs()), {}) == [("start", 1, None), ("slots full",)]
    gpus = [GpuState(index=0, name="t", total=64 * MiB, used=0)]
    needs = _needs(a=Need(1, False, None), b=Need(1, False, None))
    assert _answering(schedule(queue, running=0, limit=None, gpus=gpus, holders={}, need_of=needs), {1: False}) == [
        ("start", 1, (0,)), ("start", 2, (0,)),
    ]


def test_a_job_whose_need_cannot_be_read_is_named_and_the_pass_goes_on() -> None:
    queue = [job_row(id=1, name="broken"), job_row(id=2, name="fine")]
    gpus = [GpuState(index=0, name="t", total=64 * MiB, used=0)]

    def need_of(job):
        if job.name == "broken":
            raise KeyError("train")  # a stored spec that no longer loads
        return Need(1, False, None)

    assert _what(schedule(queue, running=0, limit=None, gpus=gpus, holders={}, need_of=need_of)) == [
        ("unschedulable", 1, "KeyError"), ("start", 2, (0,)),
    ]
