"""The dashboard in a real browser: headless Chromium driven by selenium with Debian's chromedriver,
as a person uses it. One scenario, run by tests/e2e/test_web_browser.py (which checks what it saw)
and by bench/dashboard_screenshots.py (which keeps its screenshots in bench/results/).

The scenario: a tiny built-in job, long enough to keep running, on a daemon whose emulated cap
drops early so that the runner takes a rung in-process; `oomguard serve`; the link `oomguard
web-url` prints, opened in the browser; the queue page (the job's row, its step advancing with no
reload: the page's live refresh must do it); a click on the job's link; the job page (the rung in
the list and on a chart, the step advancing there too). Chromium and chromedriver are Debian's
(`make browser-tools` installs them as root)."""

from __future__ import annotations

import base64
import importlib.util
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.conftest import Daemon, oomguard, wait_for
from tests.jobs_helpers import TINY_JOB
from tests.web_helpers import serving

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Wide enough for the queue table's twelve columns on one line each; the job page's charts
# scale with the width (svg.chart is 100 % wide).
WINDOW = (1400, 1000)
# The tiny job's full batch (about 4.1 MiB) fits until step 5; then micro-batch 4 (about
# 2.5 MiB) does and the runner steps down by itself (tests/e2e/conftest.py: TINY_CAP).
CAP = "64MiB,3500KiB@5"
MAX_STEPS = 800  # over a minute of steps (about 12 a second on a free core): it outlasts the scenario
STEP = re.compile(r"^(\d+)/(\d+)$")


def browser_missing() -> str | None:
    """Why the browser scenario cannot run here, or None when it can."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not Path(path).exists()]
    if importlib.util.find_spec("selenium") is None:
        missing.append("the selenium package (pip install -e '.[test]')")
    if not missing:
        return None
    return f"no {', '.join(missing)}: as root, `make browser-tools` installs Debian's chromium and chromium-driver"


def start_browser(window: tuple[int, int] = WINDOW) -> Any:
    """Headless Chromium under the system chromedriver, its console kept for get_log("browser")."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--window-size={window[0]},{window[1]}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def job_file(folder: Path, name: str = "tiny", max_steps: int = MAX_STEPS) -> Path:
    path = folder / f"{name}.toml"
    # A checkpoint every 50 steps, not every 4: steps, not saves, fill the run.
    path.write_text(TINY_JOB.format(name=name, batch_size=8, max_steps=max_steps, checkpoint_every_steps=50, keep_checkpoints=1))
    return path


@dataclass
class Seen:
    """What the browser showed, for the test to judge (the scenario itself only waits for it)."""

    base_url: str = ""
    row_name: str = ""
    row_state: str = ""
    queue_steps: tuple[int, int] = (0, 0)  # td.step read twice on one page, some seconds apart
    job_steps: tuple[int, int] = (0, 0)  # dd.step, likewise
    new_plan: str = ""  # the plan the runner stepped down to (its escalation event)
    rungs: list[str] = field(default_factory=list)  # ol.rungs li texts
    rung_marks: int = 0  # g.mark.rung in the page's SVG charts
    charts: int = 0
    reloaded: list[str] = field(default_factory=list)  # pages whose window marker vanished (a reload)
    console: list[dict[str, Any]] = field(default_factory=list)  # get_log("browser") entries
    urls: list[str] = field(default_factory=list)  # every resource and navigation the pages fetched
    screenshots: dict[str, Path] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def run_scenario(daemon: Daemon, folder: Path, shots: Path, note: Callable[[str], None] = lambda _: None) -> Seen:
    """The scenario on a started ``daemon`` (its cap: CAP); screenshots in ``shots``."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    seen = Seen()
    started = time.monotonic()

    def lap(name: str) -> None:
        seen.timings[name] = round(time.monotonic() - started, 1)
        note(f"{seen.timings[name]:5.1f} s  {name}")

    oomguard("submit", str(job_file(folder)), state_dir=daemon.state_dir, check=True)
    escalation = wait_for(lambda: [e for e in daemon.show("1")["events"] if e["kind"] == "escalated"], 90, "the runner's rung (an escalated event)")
    seen.new_plan = str(escalation[0]["data"]["to"])
    lap("job submitted, rung taken")
    with serving(daemon.state_dir) as dashboard:
        seen.base_url = dashboard.base_url
        link = oomguard("web-url", state_dir=daemon.state_dir, check=True).stdout.strip()
        driver = start_browser()
        lap("dashboard and browser started")
        try:
            wait = WebDriverWait(driver, 20, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))

            def text(selector: str) -> str:
                return driver.find_element(By.CSS_SELECTOR, selector).text.strip()

            def step(selector: str) -> int:
                match = STEP.match(text(selector))
                assert match, f"{selector}: {text(selector)!r} is not STEP/MAX"
                return int(match.group(1))

            def advancing(selector: str, page: str) -> tuple[int, int]:
                """The step now, then again once the live refresh has brought a later one (at
                least 2 s on, so more than one refresh may come); no driver.get in between."""
                driver.execute_script("window.oomguardMarker = 'still this page';")
                first, at = step(selector), time.monotonic()
                later = wait.until(lambda _: time.monotonic() - at >= 2 and (s := step(selector)) > first and s)
                if driver.execute_script("return window.oomguardMarker;") != "still this page":
                    seen.reloaded.append(page)
                return first, later

            def collect_urls() -> None:
                seen.urls += driver.execute_script(
                    "return performance.getEntriesByType('navigation').concat(performance.getEntriesByType('resource')).map(e => e.name);"
                )

            # The link: its first visit sets the cookie and redirects to the queue.
            driver.get(link)
            wait.until(lambda d: "token=" not in d.current_url and d.find_elements(By.CSS_SELECTOR, 'tr[data-job="1"]'))
            row = 'tr[data-job="1"]'
            wait.until(lambda d: d.find_element(By.CSS_SELECTOR, row).get_attribute("class") == "state-running" and step(f"{row} td.step") > 0)
            seen.row_name = text(f"{row} td:nth-child(2)")
            seen.row_state = text(f"{row} td.state")
            lap("queue page shown")
            seen.queue_steps = advancing(f"{row} td.step", "queue")
            lap("queue step advanced")
            seen.screenshots["queue"] = screenshot(driver, shots / "dashboard-queue.png")
            collect_urls()

            # The job's page, by its link in the row (the live refresh may swap the row under us).
            wait.until(lambda d: d.find_element(By.CSS_SELECTOR, f'{row} a[href="/jobs/1"]').click() or True)
            wait.until(lambda d: d.current_url.endswith("/jobs/1") and d.find_elements(By.CSS_SELECTOR, "dd.step"))
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "ol.rungs li") and d.find_elements(By.CSS_SELECTOR, "svg.chart g.mark.rung"))
            seen.rungs = [li.text.strip() for li in driver.find_elements(By.CSS_SELECTOR, "ol.rungs li")]
            seen.rung_marks = len(driver.find_elements(By.CSS_SELECTOR, "svg.chart g.mark.rung"))
            seen.charts = len(driver.find_elements(By.CSS_SELECTOR, "svg.chart"))
            lap("job page shown")
            seen.job_steps = advancing("dd.step", "job")
            lap("job step advanced")
            seen.screenshots["job"] = screenshot(driver, shots / "dashboard-job.png")
            collect_urls()
            seen.console = driver.get_log("browser")
        finally:
            driver.quit()
    oomguard("cancel", "1", state_dir=daemon.state_dir)
    lap("done")
    return seen


def screenshot(driver: Any, path: Path) -> Path:
    """The whole page, not only the window, down to the end of its content (Chromium through the
    DevTools protocol). The window's full width: captured beyond the viewport the page has no
    scrollbar, and its content widens by one."""
    width, height = driver.execute_script("return [window.innerWidth, Math.ceil(document.body.getBoundingClientRect().height)];")
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {"format": "png", "captureBeyondViewport": True, "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}},
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def chromium_version() -> str:
    result = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True)
    return result.stdout.strip() or "?"
