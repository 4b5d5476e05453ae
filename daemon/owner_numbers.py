"""Numbers read from files a job's owner writes (heartbeat.json, metrics.jsonl, outcome.json):
anything may stand there. A number is a JSON int or float, not a bool, not NaN or infinite,
and at most 2**63 in size: a 400-digit integer overflowed every float conversion and
formatting after it (`status`, the report, the dashboard)."""

from __future__ import annotations

from typing import Any

LIMIT = 2**63


def owner_number(value: Any) -> int | float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) <= LIMIT:
        return value
    return None


def owner_int(value: Any) -> int | None:
    number = owner_number(value)
    return int(number) if number is not None else None


def owner_float(value: Any) -> float | None:
    number = owner_number(value)
    return float(number) if number is not None else None
