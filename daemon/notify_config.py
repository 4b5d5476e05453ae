"""The apprise configuration the notifier sends through: apprise's own default files, and each
file parsed when the daemon starts, so that a mistake in it is reported then (redacted), not
at the first message."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import apprise
from apprise.config.file import ConfigFile

from oomguard.daemon.notify_apprise import captured_warnings
from oomguard.daemon.notify_redact import redact_text

CONFIG_HELP = "https://appriseit.com/getting-started/configuration/"


def default_config_paths() -> list[Path]:
    """Apprise's own default configuration files that exist, in apprise's order. Like the
    apprise CLI, $APPRISE_CONFIG_PATH (paths separated by ';' or newlines) replaces the
    default list when it is set."""
    from apprise.cli import DEFAULT_CONFIG_PATHS  # the CLI module imports click: only here

    env = os.environ.get("APPRISE_CONFIG_PATH", "").strip()
    candidates = re.split(r"[\r\n;]+", env) if env else list(DEFAULT_CONFIG_PATHS)
    found: list[Path] = []
    for candidate in candidates:
        path = Path(os.path.expandvars(os.path.expanduser(candidate.strip())))
        if candidate.strip() and path.is_file() and path not in found:
            found.append(path)
    return found


def load_config(path: Path, asset: apprise.AppriseAsset, log: Callable[[str], None]) -> ConfigFile | None:
    """Parse one apprise configuration file now (not at the first message) so a mistake is
    reported when the daemon starts; None when it yields no server at all."""
    if not path.is_file():
        log(
            f"notifier: apprise configuration {path} does not exist (or is not a file); "
            f"create it (see {CONFIG_HELP}) or leave it out of the configuration paths"
        )
        return None
    with captured_warnings() as problems:
        try:
            config = ConfigFile(path=str(path), asset=asset)
            services = config.services()
        except Exception as error:  # a parser bug must not stop the daemon
            problems.append(f"{type(error).__name__}: {error}")
            services = []
    # Apprise's "Failed to load ..." line only repeats the path; the reasons come first.
    reasons = [p.rstrip(".") for p in problems if not p.startswith("Failed to load Apprise configuration")]
    urls = [service.url() for service in services]
    if not services:
        log(
            f"notifier: apprise configuration {path} gives no notification server"
            f"{': ' + redact_text('; '.join(reasons), urls) if reasons else ''}; "
            f"fix it (TEXT: one URL per line, 'tag=URL'; YAML needs a .yml/.yaml name; see {CONFIG_HELP})"
        )
        return None
    if reasons:
        log(
            f"notifier: apprise configuration {path} has entries that were skipped: "
            f"{redact_text('; '.join(reasons), urls)}; fix them (see {CONFIG_HELP})"
        )
    return config
