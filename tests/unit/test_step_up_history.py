"""Stepping back up across attempts (strategies/step_up_history.py): what a new attempt is told
of the job's earlier ones, the doctor's answer to a runner that ended its attempt to change
plans ("replan"), which of those cost a try, and a command job's step up at a relaunch with its
back-off counted in relaunches."""

from __future__ import annotations

from oomguard.strategies.decision import NextPlan, PastAttempt, Retry
from oomguard.strategies.doctor import decide
from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.outcome import MemoryFigures, Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy
from oomguard.strategies.step_up_history import StepUpHistory, free_replan, launch_step_up, step_up_history

MiB = 2**20
OWN = Plan.initial(16)
HALF = OWN.replace(micro_batch=8)
OFFLOADED = OWN.replace(offload="optimizer")
EIGHT_BIT = OWN.replace(optimizer="adamw8bit")
POLICY = Policy(allow=("micro_batch", "offload", "optimizer_8bit"), initial=OWN, max_attempts=2)
STATIC = {"parameters": 4 * MiB, "trainable": 4 * MiB, "optimizer_state": 8 * MiB}


def ran(plan: Plan, peak_mib: float, rate: float = 100.0) -> Measurement:
    return Measurement(plan=plan, fits=True, peak_bytes=int(peak_mib * MiB), capacity=1000 * MiB, samples_per_s=rate, static=STATIC)


def oom(step: int, plan: Plan, *measured: Measurement, total_mib: int = 80) -> PastAttempt:
    memory = MemoryFigures(requested=MiB, allocated=total_mib * MiB, free=0, total=total_mib * MiB, breakdown={"optimizer_state": 8 * MiB})
    return PastAttempt(plan, Outcome(kind="oom", step=step, phase="forward", memory=memory, plan=plan, measurements=measured))


def up(plan: Plan, to: Plan, step: int, resumed_from: int) -> PastAttempt:
    record = {"step": step, "from": plan.to_dict(), "to": to.to_dict(), "reason": "stepped back up", "direction": "up", "restart": True}
    return PastAttempt(plan, Outcome(kind="replan", step=step, resumed_from=resumed_from, plan=plan, next_plan=to, recoveries=(record,)))


def test_a_new_attempt_is_told_what_it_stepped_down_from_and_what_was_measured() -> None:
    probe = {"step": 0, "from": OWN.to_dict(), "to": HALF.to_dict(), "reason": "probe: start at [mb=8x2]"}
    first = PastAttempt(HALF, Outcome(kind="oom", step=5, plan=HALF, measurements=(ran(OWN, 100), ran(HALF, 60)), recoveries=(probe,)))
    known = step_up_history([first, up(OFFLOADED, HALF, 10, 5)], POLICY, HALF)
    assert known.origin == OWN and known.above == (OWN, HALF)
    # A probe that left the job's own plan only for a faster one: not a plan to step back up to.
    faster = {**probe, "for_room": False}
    only_faster = PastAttempt(HALF, Outcome(kind="interrupted", step=5, plan=HALF, recoveries=(faster,)))
    assert step_up_history([only_faster], POLICY, HALF).above == ()
    assert known.measurements == (ran(OWN, 100), ran(HALF, 60))
    assert known.trial_from == OFFLOADED and known.failures == 0
    assert StepUpHistory.from_dict(known.to_dict()) == known


def test_a_plan_the_loss_diverged_under_is_never_gone_back_to() -> None:
    diverged = PastAttempt(EIGHT_BIT, Outcome(kind="diverged", step=7, plan=EIGHT_BIT))
    known = step_up_history([oom(3, OWN), oom(5, EIGHT_BIT), diverged], POLICY, OFFLOADED)
    assert known.above == (OWN,)


def test_the_step_ups_that_failed_count_in_every_attempt() -> None:
    back = {"step": 11, "from": OWN.to_dict(), "to": OFFLOADED.to_dict(), "reason": "did not hold", "direction": "back", "restart": True}
    failed = PastAttempt(OWN, Outcome(kind="replan", step=11, resumed_from=10, plan=OWN, next_plan=OFFLOADED, recoveries=(back,)))
    known = step_up_history([oom(5, OWN), up(OFFLOADED, OWN, 10, 5), failed], POLICY, OFFLOADED)
    assert known.failures == 1 and known.trial_from is None
    assert (known.back_off().wait, known.back_off().next_wait) == (1, 2)


def test_a_replan_costs_no_try_when_it_moved_or_went_back_from_a_step_up() -> None:
    history = [oom(5, OWN), up(OFFLOADED, OWN, 10, 5)]
    assert free_replan(history[1], history[:1])
    still = PastAttempt(OFFLOADED, Outcome(kind="replan", step=5, resumed_from=5, plan=OFFLOADED, next_plan=OWN))
    assert not free_replan(still, history[:1])  # trained nothing and was no trial: a try
    decision = decide(history[1].outcome, OFFLOADED, history, POLICY)
    assert isinstance(decision, NextPlan) and decision.plan == OWN and decision.rung == "step_up"
    # Two tries allowed: after an OOM, a replan that is not free is the second, and the last.
    assert decide(still.outcome, OFFLOADED, [history[0], still], POLICY).__class__.__name__ == "GiveUp"


def test_a_replan_to_a_plan_the_job_does_not_allow_is_refused() -> None:
    lora = OWN.replace(lora_rank=16)
    asked = PastAttempt(OFFLOADED, Outcome(kind="replan", step=10, resumed_from=5, plan=OFFLOADED, next_plan=lora))
    decision = decide(asked.outcome, OFFLOADED, [oom(5, OWN), asked], POLICY)
    assert isinstance(decision, Retry) and "takes lora (not allowed for this job)" in decision.reason


def test_a_command_job_steps_up_at_a_relaunch_and_backs_off_in_relaunches() -> None:
    measured = (ran(OWN, 100, rate=200.0), ran(HALF, 60, rate=150.0))
    interrupted = PastAttempt(HALF, Outcome(kind="time_limit", step=9, resumed_from=5, plan=HALF, measurements=measured))
    history = [oom(5, OWN, *measured), interrupted]
    assert launch_step_up(history, POLICY, HALF, 90 * MiB) is None  # the room is still short
    found = launch_step_up(history, POLICY, HALF, 120 * MiB)
    assert found is not None and found.plan == OWN
    # Launched under it, it ran out of memory: back to the plan that worked, no try used.
    failed = PastAttempt(OWN, oom(11, OWN).outcome, stepped_up=True)
    decision = decide(failed.outcome, OWN, [*history, failed], POLICY)
    assert isinstance(decision, NextPlan) and decision.plan == HALF and decision.rung == "step_up_failed"
    assert decision.reason.endswith("back to [mb=8x2], the plan that worked; the next try after 1 relaunch(es)")
    # The relaunch right after it (the way back) does not step up; the one after does.
    assert launch_step_up([*history, failed], POLICY, HALF, 120 * MiB) is None
    assert launch_step_up([*history, failed, interrupted], POLICY, HALF, 120 * MiB) is not None
    again = PastAttempt(OWN, oom(13, OWN).outcome, stepped_up=True)
    waited = [*history, failed, interrupted, again, interrupted]
    assert launch_step_up(waited, POLICY, HALF, 120 * MiB) is None  # two failures: two relaunches
    assert launch_step_up([*waited, interrupted], POLICY, HALF, 120 * MiB) is not None


def test_a_command_job_is_not_stepped_up_at_the_relaunch_the_doctor_chose_its_plan_for() -> None:
    measured = (ran(OWN, 100, rate=200.0), ran(HALF, 60, rate=150.0))
    assert launch_step_up([oom(5, OWN, *measured)], POLICY, HALF, 900 * MiB) is None


def test_a_scripts_oom_on_a_shared_card_counts_at_the_room_it_had_not_the_cards_total() -> None:
    measured = (ran(OWN, 100, rate=200.0), ran(HALF, 60, rate=150.0))
    memory = MemoryFigures(requested=MiB, allocated=70 * MiB, reserved=72 * MiB, free=8 * MiB, total=1000 * MiB)
    failed = Measurement(plan=OWN, fits=False, peak_bytes=71 * MiB, capacity=1000 * MiB)
    script_oom = PastAttempt(OWN, Outcome(kind="oom", step=5, memory=memory, measurements=(*measured, failed)))
    interrupted = PastAttempt(HALF, Outcome(kind="time_limit", step=9, resumed_from=5))
    assert memory.room == 80 * MiB
    found = launch_step_up([script_oom, interrupted], POLICY, HALF, 990 * MiB)  # the neighbour has left the card
    assert found is not None and found.plan == OWN


def test_a_replan_at_the_same_step_again_costs_a_try_and_one_that_changes_the_batch_is_refused() -> None:
    first = up(OFFLOADED, OWN, 10, 5)
    again = PastAttempt(OFFLOADED, Outcome(kind="replan", step=10, resumed_from=10, plan=OFFLOADED, next_plan=OWN, recoveries=first.outcome.recoveries))
    assert free_replan(first, [oom(5, OWN)])
    assert not free_replan(again, [oom(5, OWN), first])  # an owner's outcome.json said so once already
    bigger = PastAttempt(OFFLOADED, Outcome(kind="replan", step=12, resumed_from=10, plan=OFFLOADED, next_plan=OWN.replace(batch_size=64)))
    decision = decide(bigger.outcome, OFFLOADED, [oom(5, OWN), bigger], POLICY)
    assert isinstance(decision, Retry) and "another batch or number of processes" in decision.reason


def test_a_step_up_stays_on_trial_across_an_interruption_that_trained_nothing() -> None:
    stopped = PastAttempt(OWN, Outcome(kind="interrupted", step=10, resumed_from=10, plan=OWN))
    trained = PastAttempt(OWN, Outcome(kind="interrupted", step=12, resumed_from=10, plan=OWN))
    history = [oom(5, OWN), up(OFFLOADED, OWN, 10, 5), stopped]
    assert step_up_history(history, POLICY, OWN).trial_from == OFFLOADED
    assert step_up_history([*history, trained], POLICY, OWN).trial_from is None


def test_a_new_attempt_after_a_failed_step_up_waits_its_boundaries_from_the_first_not_from_its_start() -> None:
    from oomguard.jobs.step_ups import StepUps

    measured = (ran(OWN, 100, rate=200.0), ran(OFFLOADED, 60, rate=150.0))
    known = StepUpHistory(origin=OWN, above=(OWN,), measurements=measured, failures=1)
    runner = StepUps(known)
    assert runner.at_start(10, OFFLOADED, 500 * MiB) is None
    assert runner.at_checkpoint(12, OFFLOADED, (), (), 500 * MiB) is None  # the one boundary it waits
    assert runner.at_checkpoint(14, OFFLOADED, (), (), 500 * MiB)["to"] == OWN.to_dict()  # type: ignore[index]
    # Too many changes in the attempt: no step, but the boundary ends a trial all the same.
    trial = StepUps(StepUpHistory(origin=OWN, above=(OWN,), measurements=measured, trial_from=OFFLOADED))
    assert trial.at_checkpoint(12, OWN, (), (), 500 * MiB, may_step=False) is None and trial.on_trial_from is None
    # Where every attempt waits in a cluster's queue, no step up through a restart.
    queued = StepUps(StepUpHistory(origin=OWN, above=(OWN,), measurements=measured, restarts=False))
    assert queued.at_checkpoint(12, OFFLOADED, (), (), 500 * MiB) is None
    assert queued.at_start(12, OFFLOADED, 500 * MiB) is not None  # at the start nothing is built: no restart
