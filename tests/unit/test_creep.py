"""Creep in a step timeline (strategies/creep.py): a steady leak is found with its rate and the
step it reaches the cap; jitter, a one-time jump and too few steps are not creep."""

from __future__ import annotations

import random

import pytest

from oomguard.strategies.creep import find_creep

MiB = 2**20


def timeline(steps: int, base: int = 100 * MiB, leak: int = 0, jitter: int = 0, jump_at: int | None = None, jump: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(0)
    return [
        (step, base + leak * step + rng.randrange(jitter + 1) + (jump if jump_at is not None and step >= jump_at else 0))
        for step in range(1, steps + 1)
    ]


def test_a_steady_leak_is_found_with_its_rate_and_when_it_reaches_the_cap():
    creep = find_creep(timeline(200, leak=64 * 1024, jitter=2 * MiB), capacity=200 * MiB)
    assert creep is not None
    assert creep.bytes_per_step == pytest.approx(64 * 1024, rel=0.1)
    assert creep.first_step >= 3 and creep.last_step == 200
    # 100 MiB + 64 KiB a step (+ up to 2 MiB of jitter) reaches 200 MiB near step 1600 (the
    # rate is read from the floors, a little low under jitter).
    assert 1450 < creep.reaches_capacity_at < 1750
    text = creep.describe(200 * MiB)
    assert f"{creep.bytes_per_step / 1024:.1f} KiB per step" in text and "over steps 6-200" in text and "near step" in text


@pytest.mark.parametrize(
    "points",
    [
        timeline(200, jitter=8 * MiB),  # batches of different shapes
        timeline(200, jump_at=100, jump=10 * MiB),  # a cache filled once, a larger bucket
        timeline(20, leak=MiB),  # too few steps to tell
        timeline(200, leak=1024),  # 200 KiB over the run: under the floor
        [(step, 100 * MiB - 4096 * step) for step in range(1, 201)],  # shrinking
    ],
    ids=["jitter", "one jump", "few steps", "tiny", "shrinking"],
)
def test_what_is_not_creep(points):
    assert find_creep(points, capacity=200 * MiB) is None


def test_the_timeline_is_the_last_plans_steps_with_the_last_capacity():
    from oomguard.daemon.creep_watch import timeline

    records = [
        {"step": 1, "peak_bytes": 10, "plan": "mb=8x1", "capacity_bytes": 100},
        {"step": 2, "peak_bytes": 11, "plan": "mb=4x2", "capacity_bytes": 100},
        {"step": 3, "peak_bytes": True, "plan": "mb=4x2", "capacity_bytes": 90},
        {"step": 4, "peak_bytes": 12, "plan": "mb=4x2", "capacity_bytes": 90},
        {"step": 5, "peak_bytes": 13, "plan": "mb=4x2", "capacity_bytes": 80},
    ]
    # A plan change or a record without a peak ends the timeline (read from the end).
    assert timeline(records) == ([(4, 12), (5, 13)], 80)
    assert timeline([]) == ([], None)


def test_a_big_job_close_to_its_cap_is_warned_before_it_has_grown_by_three_per_cent():
    # 20 GiB of floor, 2 GiB to spare, 400 KiB a step over 800 steps: 0.3 GiB, 1.5 % of the floor.
    points = timeline(800, base=20 << 30, leak=400 * 1024, jitter=64 * MiB)
    assert find_creep(points, capacity=22 << 30) is not None
    assert find_creep(points, capacity=None) is None
