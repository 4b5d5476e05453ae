"""What one process learns of a bucketed job's buckets (jobs/buckets.py): which buckets fitted
under each plan, and the smaller micro-batch a bucket's own spike took under it
(strategies/bucket_spike.py). The plan stays; only that bucket's steps go in smaller slices.
Learnt again by each attempt."""

from __future__ import annotations

from typing import Any

from oomguard.strategies import rungs
from oomguard.strategies.bucket_spike import Size, bucket_micro_batch, describe
from oomguard.strategies.doctor import describe_oom
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan


class BucketLimits:
    def __init__(self) -> None:
        self._fitted: dict[Plan, set[Size]] = {}
        self._micro: dict[tuple[Plan, Size], int] = {}

    def micro_batch(self, plan: Plan, bucket: Size | None) -> int:
        """The micro-batch a step of ``bucket`` runs at under ``plan``: the plan's, or the
        smaller one that bucket's spike took under it."""
        micro = self._micro.get((plan, bucket), plan.micro_batch) if bucket is not None else plan.micro_batch
        return min(micro, plan.per_rank_batch)

    def fitted(self, plan: Plan, bucket: Size) -> None:
        self._fitted.setdefault(plan, set()).add(bucket)

    def answer(self, plan: Plan, bucket: Size, oom: Outcome, step: int) -> dict[str, Any] | None:
        """The recoveries record for ``oom`` at ``step`` when it is ``bucket``'s own (the plan
        unchanged: "for_room" False, nothing to step back up to); None when it is not, or where
        the plan allows one slice only (the optimizer step inside backward: the ladder's then)."""
        micro = self.micro_batch(plan, bucket)
        smaller = bucket_micro_batch(bucket, self._fitted.get(plan, set()), micro, plan.micro_batch_choices())
        if smaller is None or rungs.conflict(plan.replace(micro_batch=smaller)) is not None:
            return None
        return {
            "step": step, "from": plan.to_dict(), "to": plan.to_dict(), "reason": describe(bucket, micro, smaller, plan.micro_batch),
            "oom": describe_oom(oom), "bucket": list(bucket), "bucket_micro_batch": smaller, "for_room": False,
        }

    def take(self, plan: Plan, change: dict[str, Any]) -> None:
        """Apply a record ``answer`` made (on this rank or rank 0)."""
        self._micro[(plan, tuple(change["bucket"]))] = change["bucket_micro_batch"]
