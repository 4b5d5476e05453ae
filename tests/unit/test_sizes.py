"""Capacity schedules (the sizes themselves: tests/unit/test_units.py)."""

import dataclasses

import pytest

from oomguard.jobs.sizes import CapSchedule
from oomguard.strategies.units import GiB, MiB


def test_cap_schedule_single_size_caps_from_step_zero():
    schedule = CapSchedule.parse("48MiB")
    assert schedule.entries == ((0, 48 * MiB),)
    assert schedule.limit_at(0) == 48 * MiB
    assert schedule.limit_at(10_000) == 48 * MiB


def test_cap_schedule_drop_at_step():
    schedule = CapSchedule.parse("64MiB,40MiB@15")
    assert schedule.entries == ((0, 64 * MiB), (15, 40 * MiB))
    assert [schedule.limit_at(s) for s in (0, 14, 15, 16, 99)] == [64 * MiB] * 2 + [40 * MiB] * 3


def test_cap_schedule_uncapped_before_first_entry():
    schedule = CapSchedule.parse("40MiB@15")
    assert schedule.entries == ((15, 40 * MiB),)
    assert schedule.limit_at(0) is None
    assert schedule.limit_at(14) is None
    assert schedule.limit_at(15) == 40 * MiB


def test_cap_schedule_three_entries_and_spaces():
    schedule = CapSchedule.parse(" 1GiB , 512MiB @ 3, 2GB@10 ")
    assert schedule.entries == ((0, GiB), (3, 512 * MiB), (10, 2 * 10**9))
    assert schedule.limit_at(2) == GiB
    assert schedule.limit_at(9) == 512 * MiB
    assert schedule.limit_at(10) == 2 * 10**9


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("48MiB", "48MiB"),
        ("64MiB,40MiB@15", "64MiB,40MiB@15"),
        ("40MiB@15", "40MiB@15"),
        ("64MiB@0,40MiB@15", "64MiB,40MiB@15"),
        ("48 mib", "48MiB"),
        ("1.5GiB", "1536MiB"),
        ("2GiB", "2GiB"),
        ("64MB,2GB@3", "64MB,2GB@3"),
        ("1024", "1KiB"),
        ("1000", "1kB"),
        ("1000000", "1MB"),
        ("100B@7", "100B@7"),
        ("1234567", "1234567B"),
    ],
)
def test_cap_schedule_str_is_canonical_and_round_trips(text, canonical):
    schedule = CapSchedule.parse(text)
    assert str(schedule) == canonical
    assert CapSchedule.parse(str(schedule)) == schedule


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "not a capacity schedule"),
        ("64MiB,", "not a capacity schedule"),
        ("@5", "not a capacity schedule"),
        ("64MiB,40MiB", "only the first entry may leave out @STEP"),
        ("40MiB@15,30MiB@15", "strictly increasing"),
        ("40MiB@15,30MiB@10", "strictly increasing"),
        ("40MiB@x", "not a step"),
        ("40MiB@", "not a step"),
        ("40MiB@-1", "not a step"),
        ("40MiB@1.5", "not a step"),
        ("40MiB@1@2", "not a step"),
        ("furlongs@3", "not a memory size"),
        ("0MiB@3", "positive"),
    ],
)
def test_cap_schedule_rejects(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        CapSchedule.parse(text)


def test_cap_schedule_constructor_validates():
    assert CapSchedule(((0, 10), (5, 4))).limit_at(7) == 4
    with pytest.raises(ValueError, match="at least one entry"):
        CapSchedule(())
    with pytest.raises(ValueError, match="strictly increasing"):
        CapSchedule(((5, 10), (5, 4)))
    with pytest.raises(ValueError, match=">= 0"):
        CapSchedule(((-1, 10),))
    with pytest.raises(ValueError, match="positive"):
        CapSchedule(((0, 0),))


def test_cap_schedule_is_frozen_and_hashable():
    schedule = CapSchedule.parse("64MiB,40MiB@15")
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule.entries = ()  # type: ignore[misc]
    assert {schedule: 1}[CapSchedule.parse("64MiB, 40MiB@15")] == 1
