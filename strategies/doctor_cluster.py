"""The doctor's answers to what a batch scheduler ends an attempt with (strategies/doctor.py
asks): a time limit goes on with the same plan (and more checkpoints when none was made), a
host OOM at the memory asked for asks for more, and which of these cost the job a try (none
that moved it on; those that did not, so that it cannot go round for ever)."""

from __future__ import annotations

from collections.abc import Sequence

from oomguard.strategies.decision import PastAttempt, Retry
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.units import format_bytes, format_duration_words

# A cluster's interruptions in a row that trained nothing before they cost the job's tries.
FREE_IDLE_CLUSTER_FAILURES = 3
# The shortest checkpoint interval a time limit without a checkpoint leads to.
CHECKPOINT_SECONDS_FLOOR = 10.0


def continues(outcome: Outcome, earlier: Sequence[PastAttempt]) -> bool:
    """Not the job's doing, and nothing lost: an interruption, or a time limit reached after
    the attempt trained and checkpointed, from further on than any time limit before it. One
    that trained nothing, or that resumed where an earlier one did (a script whose own
    checkpoints are rarer than its time limit), costs a try: a job must not go round for ever
    without moving."""
    if outcome.kind == "interrupted":
        return not _idle_cluster_failure(outcome) or _idle_cluster_failures_before(earlier) < FREE_IDLE_CLUSTER_FAILURES
    if outcome.kind != "time_limit" or outcome.time_limit_without_checkpoint is not None or not outcome.moved:
        return False
    before = [past.outcome.resumed_from or 0 for past in earlier if past.outcome.kind == "time_limit"]
    return not before or (outcome.resumed_from or 0) > max(before)


def _idle_cluster_failure(outcome: Outcome) -> bool:
    """An interruption of the cluster's (a node failure, a preemption) before the attempt
    trained a step: free a few times in a row, then a try each, or a node that fails each
    time the job lands on it would keep it going round for ever. (The daemon's own
    interruptions stay free: a reboot with no report from the runner reads as step 0 too.)"""
    return outcome.kind == "interrupted" and outcome.scheduler_state is not None and not outcome.moved


def _idle_cluster_failures_before(earlier: Sequence[PastAttempt]) -> int:
    streak = 0
    for past in reversed(earlier):
        if not _idle_cluster_failure(past.outcome):
            break
        streak += 1
    return streak


def after_time_limit(outcome: Outcome, plan: Plan) -> Retry:
    """A cluster's time limit: the next attempt goes on with the same plan (no rung); one that
    passed without a checkpoint made in the attempt makes the next ones checkpoint more often."""
    limit = outcome.time_limit_without_checkpoint
    if limit is None and not outcome.moved:
        return Retry(
            reason=f"the cluster's time limit came before the attempt trained a step (Slurm may signal up to a minute early); the next "
            f"attempt tries again from step {outcome.step} with the same plan [{plan.short()}]",
        )
    if limit is None:
        return Retry(reason=f"the cluster's time limit came at step {outcome.step}, after a checkpoint; the next attempt goes on from it with the same plan [{plan.short()}]")
    # Three checkpoints per time limit: at most a third of an attempt is lost when the signal
    # comes too late for the last one.
    every = max(CHECKPOINT_SECONDS_FLOOR, limit / 3)
    return Retry(
        reason=f"the cluster's time limit ({format_duration_words(limit)}) passed without a checkpoint made in the attempt (at step "
        f"{outcome.step}) -> the next attempts checkpoint at least every {format_duration_words(every)}, same plan [{plan.short()}]",
        checkpoint_every_seconds=every,
    )


def more_host_memory(outcome: Outcome, plan: Plan) -> Retry:
    """The cluster ended the attempt for going over the host memory it was given (sbatch
    --mem): the job's own limit, not a neighbour's doing, so the same request would fail the
    same way. The next attempt asks for twice as much, same plan; the cluster refuses a request
    no node can meet (sbatch says so), and max_attempts bounds the doubling."""
    limit = outcome.host_memory_limit
    assert limit is not None
    more = 2 * limit
    return Retry(
        reason=f"the cluster ended it for using more than the {format_bytes(limit)} of host memory it was given (sbatch --mem; at "
        f"step {outcome.step}) -> the next attempt asks for {format_bytes(more)}, same plan [{plan.short()}]",
        host_memory=more,
    )
