"""The daemon reads a runner's recoveries records from files the job's owner can write: a record
no runner writes is passed over, never an exception in the daemon (daemon/attempts.py)."""

from __future__ import annotations

import pytest

from oomguard.daemon.runner_recoveries import recorded_plans
from oomguard.strategies.plan import Plan

PLAN = Plan.initial(4).to_dict()


def test_a_runners_record_gives_its_two_plans():
    smaller = Plan.initial(4, micro_batch=2).to_dict()
    assert recorded_plans({"step": 3, "reason": "why", "from": PLAN, "to": smaller}) == (Plan.initial(4), Plan.initial(4, micro_batch=2))


@pytest.mark.parametrize(
    "record",
    [
        {},
        {"step": 3, "reason": "why", "from": PLAN},
        {"step": "3", "reason": "why", "from": PLAN, "to": PLAN},
        {"step": 3, "reason": 7, "from": PLAN, "to": PLAN},
        {"step": 3, "reason": "why", "from": "mb=4", "to": PLAN},
        {"step": 3, "reason": "why", "from": {"batch_size": "four"}, "to": PLAN},
    ],
)
def test_a_record_no_runner_writes_is_passed_over(record):
    assert recorded_plans(record) is None
