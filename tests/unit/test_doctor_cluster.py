"""The doctor's answers to what a cluster ends an attempt with: a time limit, a host OOM at
the memory the attempt asked for."""

from __future__ import annotations

from oomguard.strategies.decision import GiveUp, PastAttempt, Retry
from oomguard.strategies.doctor import decide
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy
from oomguard.strategies.rungs import exact_names

PLAN = Plan.initial(16)
POLICY = Policy(allow=exact_names(), max_attempts=3)


def history(*outcomes: Outcome) -> list[PastAttempt]:
    return [PastAttempt(PLAN, outcome) for outcome in outcomes]


def test_a_time_limit_after_a_checkpoint_goes_on_with_the_same_plan_and_costs_no_try() -> None:
    # Ten continuations, each resuming where the one before stopped: no try used up.
    limits = [Outcome(kind="time_limit", step=20 * (n + 1), resumed_from=20 * n or None) for n in range(10)]
    decision = decide(limits[-1], PLAN, history(*limits), POLICY)
    assert isinstance(decision, Retry) and decision.after_seconds == 0
    assert decision.host_memory is None and decision.checkpoint_every_seconds is None
    assert "same plan [mb=16x1]" in decision.reason


def test_time_limits_that_resume_from_the_same_checkpoint_cost_tries() -> None:
    # A script whose own checkpoints are rarer than its time limit: killed at the limit each
    # time after training (it moved), but it always starts again from step 100.
    stuck = Outcome(kind="time_limit", step=180, resumed_from=100)
    assert isinstance(decide(stuck, PLAN, history(stuck, stuck), POLICY), Retry)
    assert isinstance(decide(stuck, PLAN, history(stuck, stuck, stuck, stuck), POLICY), GiveUp)


def test_a_time_limit_before_the_attempt_trained_a_step_is_tried_again_but_costs_a_try() -> None:
    # Slurm may send its signal up to a minute early: an attempt can stop before its first step.
    early = Outcome(kind="time_limit", step=20, resumed_from=20)
    decision = decide(early, PLAN, history(early), POLICY)
    assert isinstance(decision, Retry) and "before the attempt trained a step" in decision.reason
    assert isinstance(decide(early, PLAN, history(early, early, early), POLICY), GiveUp)


def test_a_time_limit_without_a_checkpoint_makes_the_next_attempts_checkpoint_more_often_and_counts() -> None:
    limit = Outcome(kind="time_limit", step=0, time_limit_without_checkpoint=3600)
    decision = decide(limit, PLAN, history(limit), POLICY)
    assert isinstance(decision, Retry) and decision.checkpoint_every_seconds == 1200
    assert "checkpoint at least every 20 minutes" in decision.reason
    # It made no progress: it uses up the job's tries, so that it cannot go on for ever.
    assert isinstance(decide(limit, PLAN, history(limit, limit, limit), POLICY), GiveUp)


def test_a_host_oom_at_the_memory_asked_for_asks_for_twice_as_much() -> None:
    oom = Outcome(kind="host_oom", step=7, host_memory_limit=2**30)
    decision = decide(oom, PLAN, history(oom), POLICY)
    assert isinstance(decision, Retry) and decision.host_memory == 2 * 2**30 and decision.after_seconds == 0
    assert "1.00 GiB of host memory it was given" in decision.reason and "asks for 2.00 GiB" in decision.reason


def test_a_host_oom_of_the_machine_is_still_retried_after_a_pause() -> None:
    oom = Outcome(kind="host_oom", step=7, message="the kernel's OOM killer ended a process")
    decision = decide(oom, PLAN, history(oom), POLICY)
    assert isinstance(decision, Retry) and decision.host_memory is None and decision.after_seconds > 0


def test_a_clusters_interruptions_that_train_nothing_cost_tries_after_the_first_few() -> None:
    # A node that fails each time the job lands on it (NODE_FAIL before the first step).
    failed = Outcome(kind="interrupted", step=10, resumed_from=10, scheduler_state="NODE_FAIL")
    assert isinstance(decide(failed, PLAN, history(*[failed] * 5), POLICY), Retry)  # three free, two counted
    assert isinstance(decide(failed, PLAN, history(*[failed] * 6), POLICY), GiveUp)
    # Ones after which the job moved on, and the daemon's own, are free however many there are.
    moving = [Outcome(kind="interrupted", step=10 * (n + 1), resumed_from=10 * n or None, scheduler_state="PREEMPTED") for n in range(20)]
    assert isinstance(decide(moving[-1], PLAN, history(*moving), POLICY), Retry)
    own = Outcome(kind="interrupted")
    assert isinstance(decide(own, PLAN, history(*[own] * 20), POLICY), Retry)
