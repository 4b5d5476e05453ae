"""The scheduler's decisions as pure functions (daemon/scheduler.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from oomguard.daemon.placement import Need
from oomguard.daemon.scheduler import measure_need, pass_signature, same_reason, slot_limit
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
    queued = [job_row(id=1, plan="{}")]
    gpu = SimpleNamespace(index=0, free=1000 * 2**20, total=2**30, processes=[])
    moved_a_little = SimpleNamespace(index=0, free=1000 * 2**20 + 2**20 // 2, total=2**30, processes=[])
    moved_a_lot = SimpleNamespace(index=0, free=500 * 2**20, total=2**30, processes=[])
    assert pass_signature(queued, {}, [gpu]) == pass_signature(queued, {}, [moved_a_little])
    assert pass_signature(queued, {}, [gpu]) != pass_signature(queued, {}, [moved_a_lot])
    assert pass_signature(queued, {}, None) != pass_signature(queued, {7: object()}, None)


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
