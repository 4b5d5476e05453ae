"""The dashboard's parts that need no server: tokens, the SVG chart, the step cache."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from oomguard.daemon.report import read_metrics_file
from oomguard.daemon.web.step_cache import KEEP, StepCache
from oomguard.daemon.web.svg_chart import MAX_POINTS, Line, Mark, chart_svg
from oomguard.daemon.web.tokens import SESSION_SECONDS, Tokens
from oomguard.jobs.attempt import AttemptFiles


def test_a_token_names_one_uid_and_cannot_be_altered_into_another(tmp_path: Path) -> None:
    tokens = Tokens(tmp_path / "secrets" / "web.key")
    token = tokens.token_for(1001)
    assert tokens.uid_of(token) == 1001
    uid, mac = token.split(".")
    for forged in (f"1002.{mac}", f"{uid}.{mac[:-1]}0", f"{uid}.", ".", "", "1001", f"{uid}.{mac}.x", f"+1001.{mac}", f"١٠٠١.{mac}", f"{uid}.é"):
        assert tokens.uid_of(forged) is None, forged
    # The key is the server's alone, and the same one makes the same tokens after a restart.
    assert (tmp_path / "secrets" / "web.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "secrets").stat().st_mode & 0o777 == 0o700
    assert Tokens(tmp_path / "secrets" / "web.key").token_for(1001) == token
    assert Tokens(tmp_path / "other.key").uid_of(token) is None


def test_a_session_names_its_uid_until_it_expires_and_is_no_token(tmp_path: Path) -> None:
    tokens = Tokens(tmp_path / "web.key")
    session = tokens.session_for(1001, now=1_000_000.0)
    assert tokens.uid_of_session(session, now=1_000_000.0 + SESSION_SECONDS - 1) == 1001
    assert tokens.uid_of_session(session, now=1_000_000.0 + SESSION_SECONDS) is None  # expired
    assert tokens.uid_of_session(session, now=999_000.0) is None  # issued in the future
    uid, issued, mac = session.split(".")
    for forged in (f"1002.{issued}.{mac}", f"{uid}.{int(issued) + 3600}.{mac}", f"{uid}.{issued}.{'0' * 64}", f"{uid}.{issued}.é", tokens.token_for(1001)):
        assert tokens.uid_of_session(forged, now=1_000_000.0) is None, forged
    assert tokens.uid_of(session) is None


def test_a_damaged_key_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "web.key").write_bytes(b"short")
    with pytest.raises(ValueError, match="remove it and start `oomguard serve` again"):
        Tokens(tmp_path / "web.key")


def test_the_chart_escapes_every_text_and_drops_what_is_not_a_number() -> None:
    nasty = '</title><script>alert(1)</script>"\x1b[2J'
    svg = chart_svg(nasty, [Line(nasty, ((0, 1), (1, float("nan")), (2, 3)), "held")], [Mark(1.0, nasty, "rung", 1), Mark(float("inf"), "x", "oom")], str)
    assert "<script>" not in svg and "\x1b" not in svg and "nan" not in svg.lower().replace("nanos", "")
    assert "&lt;/title&gt;&lt;script&gt;" in svg and "\\x1b[2J" in svg
    assert re.search(r'<polyline class="line held" points="[\d.]+,[\d.]+ [\d.]+,[\d.]+">', svg)  # two points of three
    assert svg.count('<g class="mark rung">') == 1 and 'class="mark oom"' not in svg


def test_a_long_line_is_thinned_keeping_each_bins_highest_value() -> None:
    points = tuple((float(i), 1.0) for i in range(100_000))
    spike = (50_000.0, 9.0)
    points = points[:50_000] + (spike,) + points[50_001:]
    svg = chart_svg("m", [Line("held", points, "held")], [], str)
    drawn = re.search(r'points="([^"]+)"', svg).group(1).split()
    assert len(drawn) <= MAX_POINTS
    ys = sorted(float(p.split(",")[1]) for p in drawn)  # SVG's y grows downwards: the spike is the least
    assert ys[0] < ys[1]  # the spike survived the thinning, once


def test_a_cap_is_drawn_as_steps_and_an_empty_chart_says_so() -> None:
    svg = chart_svg("m", [Line("cap", ((0, 10), (5, 2), (10, 2)), "cap", steps=True)], [], str)
    coords = re.search(r'points="([^"]+)"', svg).group(1).split()
    assert len(coords) == 5 and coords[1].split(",")[0] == coords[2].split(",")[0]  # a jump straight down at x=5
    assert "no steps recorded yet" in chart_svg("m", [Line("held", (), "held")], [], str)


def metrics_line(step: int, **extra) -> str:
    return json.dumps({"step": step, "time": 1000.0 + step, "plan": "mb=8x1", "peak_bytes": 100 + step, "capacity_bytes": 10_000, "loss": 1.0, **extra}) + "\n"


def test_the_step_cache_reads_only_what_was_added_and_waits_for_an_unfinished_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(metrics_line(i) for i in range(1, 11)))
    cache, files = StepCache(), AttemptFiles(tmp_path)
    points, skipped = cache.read(files)
    assert [p.step for p in points] == list(range(1, 11)) and skipped == 0
    assert (points, skipped) == read_metrics_file(files)  # what the report's reader says
    with path.open("a") as file:
        file.write(metrics_line(11) + "not json\n" + metrics_line(12)[:20])
    points, skipped = cache.read(files)
    assert points[-1].step == 11 and skipped == 2  # the bad line, and the line being written
    with path.open("a") as file:
        file.write(metrics_line(12)[20:])
    points, skipped = cache.read(files)
    assert points[-1].step == 12 and skipped == 1
    path.unlink()
    path.write_text(metrics_line(1))  # a new file at the same path: read from its start
    assert [p.step for p in cache.read(files)[0]] == [1]
    path.unlink()
    assert cache.read(files) == ([], 0)
    # Never through a link, never a FIFO or a device (the job's owner may plant either).
    path.symlink_to("/dev/zero")
    assert cache.read(files) == ([], 0)
    path.unlink()
    os.mkfifo(path)
    assert cache.read(files) == ([], 0)


def test_a_long_run_is_kept_thinned_with_its_highest_peak_and_its_ends(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(metrics_line(i, **({"peak_bytes": 10**9} if i == 7_777 else {})) for i in range(1, 20_001)))
    points, _ = StepCache().read(AttemptFiles(tmp_path))
    assert KEEP // 2 <= len(points) <= KEEP
    assert max(p.peak_bytes for p in points) == 10**9
    assert points[-1].step == 20_000 and points[0].time <= 1000.0 + 8
    assert all(p.loss == pytest.approx(1.0) for p in points)


def test_numbers_past_2_63_in_an_owners_files_are_no_numbers(tmp_path: Path) -> None:
    """A 400-digit integer in metrics.jsonl or heartbeat.json overflowed float() and the size's
    formatting: `oomguard report`, status and the dashboard's pages failed."""
    from oomguard.daemon.queue_rows import queue_row
    from oomguard.jobs.spec import load_job_file
    from tests.e2e.conftest import tiny_job
    from tests.fakes import job_row

    huge = 10**400
    (tmp_path / "metrics.jsonl").write_text(metrics_line(1, peak_bytes=huge, loss=huge) + json.dumps({"step": 2, "time": huge}) + "\n")
    points, skipped = read_metrics_file(AttemptFiles(tmp_path))
    assert [(p.step, p.peak_bytes, p.loss) for p in points] == [(1, None, None)] and skipped == 1
    spec = json.dumps(load_job_file(tiny_job(tmp_path)).to_dict())
    row = queue_row(job_row(state="running", spec=spec), None, 1, {"step": huge, "samples_per_s": 1, "reserved_bytes": huge, "peak_bytes": 5})
    assert (row.step, row.held_bytes, row.eta_seconds is not None) == (0, 5, True)
