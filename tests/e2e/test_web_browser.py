"""The dashboard in a real browser (headless Chromium, selenium, Debian's chromedriver): a person
opens the link `oomguard web-url` prints, sees a running job's row on the queue and its step
advance with no reload, clicks through to the job's page and sees the rung its runner took in the
list and on a chart; the console has no error and nothing was fetched from anywhere but the
dashboard. The scenario is tests/web_browser.py's, shared with bench/dashboard_screenshots.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.web_browser import CAP, MAX_STEPS, browser_missing, run_scenario

pytestmark = pytest.mark.slow

if (why := browser_missing()) is not None:
    pytest.skip(why, allow_module_level=True)


def test_a_person_watches_a_running_job_take_a_rung_in_the_browser(tmp_path: Path, daemon_factory) -> None:
    daemon = daemon_factory("--emulate-device-memory", CAP)
    started = time.monotonic()
    seen = run_scenario(daemon, tmp_path, tmp_path / "screenshots", note=print)
    print(f"browser scenario: {time.monotonic() - started:.1f} s ({seen.timings})")
    print(f"steps: queue {seen.queue_steps}, job {seen.job_steps}; rungs {seen.rungs}; fetched {sorted(set(seen.urls))}")

    # The queue page: the job's row as a person reads it, and its step moving on by itself.
    assert (seen.row_name, seen.row_state) == ("tiny", "running")
    first, later = seen.queue_steps
    assert 0 < first < later <= MAX_STEPS, seen.queue_steps
    # The job page, reached by the row's link: the rung in the list and on the charts.
    assert seen.rungs and any(seen.new_plan in rung for rung in seen.rungs), (seen.new_plan, seen.rungs)
    assert seen.charts == 2 and seen.rung_marks >= 1, (seen.charts, seen.rung_marks)
    first, later = seen.job_steps
    assert 0 < first < later <= MAX_STEPS, seen.job_steps
    assert not seen.reloaded, f"the page reloaded instead of refreshing its live part: {seen.reloaded}"
    # No JavaScript error, failed load or refused request (a CSP violation is a console error
    # too; so was the 404 of /favicon.ico, which Chromium asks for unless a page names an icon).
    errors = [entry for entry in seen.console if entry["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
    # Nothing fetched off the box: every page, script, style sheet and live fragment came from the
    # dashboard itself.
    assert seen.urls and all(url.startswith(seen.base_url) for url in seen.urls), seen.urls
    assert any("fragment=1" in url for url in seen.urls), seen.urls  # the live refresh did fetch
    for name, path in seen.screenshots.items():
        assert path.stat().st_size > 10_000 and path.is_relative_to(tmp_path), (name, path)
