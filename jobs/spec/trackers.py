"""train.log_with: the experiment trackers a built-in job's training metrics go to (the runner
writes them through accelerate's trackers: jobs/tracking.py).

Read without importing the trackers' packages (the daemon and the CLI never import torch or
accelerate): a tracker whose package is not installed is refused here, when the job file is
checked, rather than failing in every attempt.
"""

from __future__ import annotations

import importlib.util

from oomguard.jobs.spec.reader import Section, render_value

# The trackers the runner knows how to open (jobs/tracking.py), each with the module it needs
# and the package that provides it (what `pip install` takes).
TRACKER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
# TensorBoard event files in the job's workdir: local, no account, what a user's chart expects.
DEFAULT_LOG_WITH: tuple[str, ...] = ("tensorboard",)


def parse_log_with(s: Section) -> tuple[str, ...]:
    """train.log_with: a list of tracker names (``[]``: no metrics beyond metrics.jsonl)."""
    names = s.names("log_with", tuple(TRACKER_PACKAGES), "tracker", default=DEFAULT_LOG_WITH)
    if s.has("log_with"):
        # Only trackers named in the file: a job that leaves the key out is never refused
        # for the default's package (the runner reports its absence and trains on).
        for name in names:
            module, package = TRACKER_PACKAGES[name]
            if not _installed(module):
                raise s.fail(
                    "log_with",
                    f"tracker {render_value(name)} needs the Python package {package}, which is not installed where oomguard "
                    f"runs: `pip install {package}` into oomguard's environment, or remove {render_value(name)} from log_with",
                )
    return tuple(names)


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (a tracker's import is slow)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module left half-imported
        return False
