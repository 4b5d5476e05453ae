#!/usr/bin/env python
"""Screenshots of `oomguard serve`'s dashboard as a person sees it in a browser: the queue page
(bench/results/dashboard-queue.png) and a job's page (bench/results/dashboard-job.png), whole
pages, in headless Chromium.

The scenario is tests/e2e/test_web_browser.py's (tests/web_browser.py: run_scenario): a real
`oomguard daemon` in a temporary state directory, under an emulated device whose cap drops at
step 5 so that a tiny built-in job's runner takes a rung in-process; the link `oomguard web-url`
prints, opened in the browser; the queue page once the job's step has advanced by the page's live
refresh; the job page, reached by the row's link, with the rung in its list and on its charts.
About 20 s on 2 cores. Needs Debian's chromium and chromium-driver (`make browser-tools`, as
root) and selenium (the `test` extra).

Run it with ``.venv/bin/python bench/dashboard_screenshots.py`` (``--out DIR`` elsewhere).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.conftest import Daemon, kill_leftovers  # noqa: E402
from tests.web_browser import CAP, browser_missing, chromium_version, run_scenario  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the PNGs go (default: bench/results)")
    args = parser.parse_args()
    if (why := browser_missing()) is not None:
        print(f"dashboard screenshots skipped: {why}")  # as the browser test skips: `make bench` goes on
        return 0
    folder = Path(tempfile.mkdtemp(prefix="oomguard-dashboard-"))
    daemon = Daemon(folder / "state", "--emulate-device-memory", CAP)
    started = time.monotonic()
    try:
        daemon.start()
        seen = run_scenario(daemon, folder, args.out, note=print)
    finally:
        if daemon.alive():
            daemon.stop()
        kill_leftovers(folder)
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{chromium_version()}; {time.monotonic() - started:.1f} s")
    print(f"queue page: step {seen.queue_steps[0]} -> {seen.queue_steps[1]} without a reload; job page: rungs {seen.rungs}")
    for name, path in seen.screenshots.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
