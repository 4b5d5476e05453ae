"""`oomguard status`'s plan column: the plan a job trains under, not only its stored plan."""

from __future__ import annotations

import json

from oomguard.daemon.queue_rows import PLAN_WIDTH, plan_shown
from oomguard.strategies.plan import Plan
from tests.fakes import job_row

STORED = json.dumps(Plan.initial(16).to_dict())  # mb=16x1: what the job's first attempt started with


def test_a_queued_job_shows_the_plan_its_next_attempt_starts_with() -> None:
    assert plan_shown(job_row(state="queued", plan=STORED), {"plan": "mb=8x2"}) == "mb=16x1"


def test_a_job_that_ran_shows_the_plan_its_attempt_moved_to_in_the_process() -> None:
    # The quickstart demo: a rung taken inside the runner at step 15; the stored plan is the
    # attempt's first, the heartbeat the plan it trained the last steps with.
    for state in ("running", "finished", "failed"):
        assert plan_shown(job_row(state=state, plan=STORED), {"plan": "mb=8x2"}) == "mb=8x2"


def test_a_heartbeat_without_a_plan_text_leaves_the_stored_plan() -> None:
    for heartbeat in ({}, {"plan": None}, {"plan": 7}, {"plan": ""}, {"plan": ["mb=1x16"]}):
        assert plan_shown(job_row(state="running", plan=STORED), heartbeat) == "mb=16x1"


def test_a_plan_text_from_the_owners_file_is_one_short_inert_line() -> None:
    shown = plan_shown(job_row(state="running", plan=STORED), {"plan": "mb=8x2\x1b[2J\n" + "x " * 200})
    assert len(shown) <= PLAN_WIDTH and "\x1b" not in shown and "\n" not in shown and shown.startswith("mb=8x2\\x1b[2J")
