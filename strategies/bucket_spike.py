"""A spike from one aspect-ratio bucket (jobs/buckets.py): when a step of a bucket with more
pixels runs out of memory where steps of smaller buckets fit under the same plan, the answer
is that bucket's own: its steps run in smaller micro-batches (exact: gradients accumulate over
the slices, each weighted by its share), while every other bucket keeps the plan's. Slowing
every step for a rare bucket would be the ladder's answer to a problem only that bucket has.
"""

from __future__ import annotations

from collections.abc import Collection

# A bucket as (width, height) in pixels: this module is the doctor's and imports no torch.
Size = tuple[int, int]


def bucket_micro_batch(bucket: Size, fitted: Collection[Size], micro: int, choices: list[int]) -> int | None:
    """The micro-batch for the steps of ``bucket`` after one ran out of memory at ``micro``,
    when the OOM is the bucket's own: it never fitted under this plan, a bucket of fewer pixels
    did, and none of as many or more did (else the cause is not its size: fragmentation, growth).
    The next smaller of ``choices`` (the plan's micro-batch choices) at about half; None when
    the OOM is not the bucket's, or at a micro-batch of 1 (the doctor's, then)."""
    area = bucket[0] * bucket[1]
    areas = [width * height for width, height in fitted]
    if micro <= 1 or bucket in fitted or not any(a < area for a in areas) or any(a >= area for a in areas):
        return None
    smaller = [size for size in choices if size <= (micro + 1) // 2]
    return smaller[-1] if smaller else 1


def describe(bucket: Size, micro: int, smaller: int, plan_micro: int) -> str:
    width, height = bucket
    return (
        f"batches of the {width}x{height} bucket are larger than the ones that fit under this plan: its steps now run in "
        f"micro-batches of {smaller} (was {micro}; exact), every other bucket's keep {plan_micro}"
    )
