"""Sizes and durations (strategies/units.py): what people write, what PyTorch prints, what oomguard prints."""

from decimal import Decimal

import pytest

from oomguard.strategies.units import (
    GiB,
    KiB,
    MiB,
    describe_size,
    duration_axis_unit,
    format_bytes,
    format_duration_short,
    format_duration_words,
    format_mib,
    format_torch_size,
    parse_size,
    printed_size_bytes,
    size_axis_unit,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("48MiB", 48 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("512KiB", 512 * KiB),
        ("64MB", 64 * 10**6),
        ("2GB", 2 * 10**9),
        ("100B", 100),
        ("1024", 1024),
        ("48 MiB", 48 * MiB),
        ("  48mib  ", 48 * MiB),
        ("2gb", 2 * 10**9),
        ("4kb", 4000),
        ("1TiB", 1024**4),
        ("0.5KiB", 512),
        (".5 MiB", MiB // 2),
        ("3.", 3),
        ("0.1GiB", 107374182),  # 107374182.4 rounds to whole bytes
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["48 furlongs", "", "   ", "MiB", "abc", "1.2.3MiB", "48M", "1e3MiB", "48 Mi B", "48MiB@3", "0x10"],
)
def test_parse_size_rejects_garbage_naming_it_and_the_expected_form(text):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    message = str(info.value)
    assert repr(text) in message
    assert "48MiB" in message and "1.5GiB" in message


def test_parse_size_error_message_reads_well():
    with pytest.raises(ValueError) as info:
        parse_size("48 furlongs")
    assert str(info.value) == (
        "not a memory size: '48 furlongs' (expected a number and a unit such as 48MiB, 1.5GiB or 2GB)"
    )


@pytest.mark.parametrize("text", ["0", "0MiB", "-5MiB", "-1", "0.1B", "+0GB"])
def test_parse_size_rejects_zero_and_negative(text):
    with pytest.raises(ValueError, match="positive"):
        parse_size(text)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        # c10's format_torch_size: "<= 1024" bytes, "<= 1048576" KiB, "<= 1073741824" MiB, else GiB.
        (0, "0 bytes"),
        (1, "1 bytes"),
        (1023, "1023 bytes"),
        (1024, "1024 bytes"),
        (1025, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (MiB, "1024.00 KiB"),
        (MiB + 1, "1.00 MiB"),
        (3 * MiB, "3.00 MiB"),
        (20 * MiB, "20.00 MiB"),
        (45 * MiB + MiB // 2, "45.50 MiB"),
        (GiB, "1024.00 MiB"),
        (GiB + 1, "1.00 GiB"),
        (3 * GiB // 2, "1.50 GiB"),
        (int(79.65 * GiB), "79.65 GiB"),
    ],
)
def test_format_torch_size_matches_pytorch(n, expected):
    assert format_torch_size(n) == expected


def test_format_torch_size_rejects_negative():
    with pytest.raises(ValueError):
        format_torch_size(-1)


@pytest.mark.parametrize(
    ("number", "unit", "binary_kb", "expected"),
    [
        ("20.00", "MiB", False, 20 * 2**20),
        ("7.79", "GiB", False, round(Decimal("7.79") * 2**30)),
        ("123456", "bytes", False, 123456),
        ("0", "bytes", False, 0),
        ("1024.00", "KiB", False, 2**20),
        ("1.00", "TiB", False, 2**40),
        ("1.2", "GB", True, round(Decimal("1.2") * 2**30)),  # MPS: 1024-based, labelled GB
        ("1.2", "GB", False, 1_200_000_000),
        ("768.00", "MB", True, 768 * 2**20),
        ("5", "KB", False, 5000),
        ("3206250496", "B", False, 3206250496),
    ],
)
def test_printed_size_bytes(number: str, unit: str, binary_kb: bool, expected: int) -> None:
    assert printed_size_bytes(number, unit, binary_kb=binary_kb) == expected


def test_describe_size() -> None:
    assert [describe_size(n) for n in (None, 0, 1023, 2048, 5 * 2**20, 3 * 2**30 // 2)] == [
        "?", "0 bytes", "1023 bytes", "2.00 KiB", "5.00 MiB", "1.50 GiB",
    ]



@pytest.mark.parametrize(("n", "expected"), [(None, "?"), (0, "0.0 KiB"), (512, "0.5 KiB"), (MiB - 1, "1024.0 KiB"), (MiB, "1.0 MiB"), (GiB - 1, "1024.0 MiB"), (GiB, "1.00 GiB"), (2**40, "1024.00 GiB")])
def test_format_bytes_one_decimal_below_a_gib(n, expected):
    assert format_bytes(n) == expected


@pytest.mark.parametrize(("n", "expected"), [(0, "0.0 MiB"), (MiB // 10, "0.1 MiB"), (int(18.9 * MiB), "18.9 MiB"), (200 * MiB, "200.0 MiB"), (2 * GiB, "2048.0 MiB")])
def test_format_mib_always_mib(n, expected):
    assert format_mib(n) == expected


def test_the_size_formatters_differ_where_they_should():
    # c10's inclusive thresholds vs describe_size's, TiB only in describe_size.
    assert (format_torch_size(1024), describe_size(1024), format_bytes(1024)) == ("1024 bytes", "1.00 KiB", "1.0 KiB")
    assert (format_torch_size(2**40), describe_size(2**40)) == ("1024.00 GiB", "1.00 TiB")
    assert describe_size(-2048) == "-2.00 KiB"


@pytest.mark.parametrize(
    ("seconds", "short", "words"),
    [(0, "0s", "0 s"), (45, "45s", "45 s"), (89, "89s", "89 s"), (90, "2m", "90 s"), (119, "2m", "119 s"),
     (120, "2m", "2 minutes"), (89 * 60, "89m", "89 minutes"), (90 * 60, "1.5h", "90 minutes"),
     (47 * 3600, "47.0h", "2820 minutes"), (48 * 3600, "2.0d", "2880 minutes")],
)
def test_format_duration(seconds, short, words):
    assert format_duration_short(seconds) == short
    assert format_duration_words(seconds) == words


@pytest.mark.parametrize(("span", "unit"), [(0, "s"), (179, "s"), (180, "min"), (3 * 3600 - 1, "min"), (3 * 3600, "h"), (3 * 86400, "days")])
def test_duration_axis_unit(span, unit):
    name, seconds = duration_axis_unit(span)
    assert name == unit
    assert seconds == {"s": 1.0, "min": 60.0, "h": 3600.0, "days": 86400.0}[unit]


@pytest.mark.parametrize(("largest", "unit"), [(0, "KiB"), (MiB - 1, "KiB"), (MiB, "MiB"), (GiB, "GiB")])
def test_size_axis_unit(largest, unit):
    assert size_axis_unit(largest) == (unit, float({"KiB": KiB, "MiB": MiB, "GiB": GiB}[unit]))
