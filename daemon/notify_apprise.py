"""How oomguard calls apprise, wherever it does (notify_redact.py, notify_config.py,
notifier.py).

Apprise's own log records (from the threads that call into apprise here) are caught by a filter
on the ``apprise`` logger: warnings and errors become part of our one-line reports (redacted),
the rest is dropped, so nothing of apprise's reaches stdout or the root logger on its own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import apprise


class _AppriseLogRouter(logging.Filter):
    """A filter on the ``apprise`` logger: records from a thread inside ``captured_warnings()``
    go to that thread's list (warnings and errors only) and no further; records from any
    other thread pass untouched. A logger filter runs before handlers and propagation,
    so what we catch never reaches stdout or the root logger as well."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        sink = getattr(self.local, "sink", None)
        if sink is None:
            return True
        if record.levelno >= logging.WARNING:
            sink.append(record.getMessage())
        return False


_ROUTER = _AppriseLogRouter()
logging.getLogger(apprise.LOGGER_NAME).addFilter(_ROUTER)


@contextlib.contextmanager
def captured_warnings() -> Iterator[list[str]]:
    """Collect what apprise warns about in this thread while the block runs."""
    outer = getattr(_ROUTER.local, "sink", None)
    sink: list[str] = []
    _ROUTER.local.sink = sink
    try:
        yield sink
    finally:
        _ROUTER.local.sink = outer


def apprise_asset() -> apprise.AppriseAsset:
    # async_mode=False and service_timeout=0: deliver in the calling thread (our worker)
    # instead of apprise's shared thread pools. Each plugin's socket timeouts still bound
    # a call; the worker is the only thing a hung server can hold up.
    return apprise.AppriseAsset(
        app_id="oomguard", app_desc="oomguard training supervisor", async_mode=False, service_timeout=0
    )
