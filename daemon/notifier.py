"""Tell people about their jobs through apprise, without ever stalling the daemon.

Design:

- One background worker thread does all the network I/O. ``notify()`` only checks the
  event filter and the throttle, queues the message and returns, so a slow or dead
  notification server can never hold up the scheduler's loop (or systemd's watchdog
  pings). All apprise objects are touched by that one thread only (apart from the global
  configuration, parsed once in ``__init__`` before the thread starts), and apprise is
  told to deliver sequentially with no overall service timeout, so it starts no thread
  pools of its own and ``close()`` has exactly one thread to join.
- Each (message, server) pair is delivered and retried on its own: when one of three
  servers fails, only that one is tried again (the other two must not get the message
  twice). Retries wait in a heap ordered by due time; a new message always goes before a
  due retry, so a server that is down does not delay the first try of anything else.
  Retries are counted and capped (``retry_delays``), then dropped with a log line.
- Throttle: a job that fails the same way in a loop (the doctor retries, OOMs again at the
  same step) must not page someone every minute. A message with the same job, event and
  summary as one queued within ``throttle_seconds`` is suppressed.
- Redaction: every line this module logs is redacted (notify_redact.py) and escaped
  (daemon/text.py): an error message a server sends back cannot add a line of its own to the
  log, nor show a URL's secrets.
- What a message says is notify_message.py; the apprise configuration, notify_config.py; how
  apprise is called (its log records caught, delivery in the calling thread), notify_apprise.py.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import apprise

from oomguard.daemon.notify_apprise import apprise_asset, captured_warnings
from oomguard.daemon.notify_config import default_config_paths, load_config
from oomguard.daemon.notify_message import DEFAULT_EVENTS, JobFacts, compose
from oomguard.daemon.notify_redact import redact_text, redact_url
from oomguard.daemon.text import escape

__all__ = ["Notifier"]

# How the message looks in services that show a colour or an icon for its kind.
_NOTIFY_TYPES = {
    "failed": apprise.NotifyType.FAILURE,
    "finished": apprise.NotifyType.SUCCESS,
    "escalated": apprise.NotifyType.WARNING,
    "stalled": apprise.NotifyType.WARNING,
    "waiting_for_disk": apprise.NotifyType.WARNING,
    "creep": apprise.NotifyType.WARNING,
}


@dataclass
class _Message:
    facts: JobFacts
    title: str
    body: str
    urls: tuple[str, ...]
    tags: tuple[str, ...]

    @property
    def what(self) -> str:
        return f"'{self.facts.event}' notification for job {self.facts.job_id} ({self.facts.job_name})"


@dataclass
class _Delivery:
    """One message to one server, with its retry count."""

    message: _Message
    service: apprise.NotifyBase
    label: str  # the server's URL, redacted
    secrets: tuple[str, ...]  # URLs that may appear in apprise's messages about it
    tries: int = 0


class Notifier:
    """Sends job notifications from one background thread; see the module docstring."""

    def __init__(
        self,
        config_paths: Sequence[Path] | None = None,
        *,
        throttle_seconds: float = 600.0,
        retry_delays: Sequence[float] = (10.0, 60.0, 300.0, 1800.0),
        log: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``config_paths`` None: apprise's default configuration files; ``[]``: none.
        ``clock`` is used for the throttle; retries wait in real (monotonic) time."""
        self.throttle_seconds = throttle_seconds
        self.retry_delays = tuple(retry_delays)
        # The daemon's stdout is a pipe to journald: a plain print would sit in the buffer.
        self._log = functools.partial(print, flush=True) if log is print else log
        self._clock = clock
        self._asset = apprise_asset()
        self._global = apprise.Apprise(asset=self._asset)
        paths = default_config_paths() if config_paths is None else [Path(p) for p in config_paths]
        for path in paths:
            config = load_config(path, self._asset, self._log)
            if config is not None:
                self._global.add(config)
        # Full URLs of the configured servers, for redacting apprise's messages about them.
        self._global_urls = tuple(service.url() for service in self._global.find(tag="all"))

        self._sent: dict[tuple[int, str, str], float] = {}  # throttle: key -> clock time queued
        self._told_no_target: set[int] = set()
        self._told_bad_url: set[tuple[int, str]] = set()
        self._lock = threading.Condition()
        self._fresh: deque[_Message] = deque()
        self._retries: list[tuple[float, int, _Delivery]] = []  # heap by due time
        self._seq = itertools.count()  # heap tie-breaker: deliveries do not compare
        self._busy = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="oomguard-notifier", daemon=True)
        self._thread.start()

    # -- the caller's side (any thread) --

    def notify(
        self,
        facts: JobFacts,
        *,
        urls: Sequence[str] = (),
        tags: Sequence[str] = (),
        events: Sequence[str] = DEFAULT_EVENTS,
    ) -> bool:
        """Queue a message about ``facts`` and return at once (never blocks, never raises).
        False when the event is not wanted, is a duplicate within the throttle window, or
        the notifier is closed.

        Servers: those of the global configuration that ``tags`` select, as apprise's
        ``--tag`` does (each item is an alternative; 'a, b' in one item needs both tags;
        no tags: only untagged entries), plus the job's own ``urls``."""
        # A lone string is one URL or one tag, not a sequence of characters.
        urls = (urls,) if isinstance(urls, str) else tuple(urls)
        tags = (tags,) if isinstance(tags, str) else tuple(tags)
        try:
            if facts.event not in events:
                return False
            key = (facts.job_id, facts.event, facts.summary)
            title, body = compose(facts)
            now = self._clock()
            with self._lock:
                closed = self._closing
                last = self._sent.get(key)
                duplicate = last is not None and now - last < self.throttle_seconds
                if not (closed or duplicate):
                    # Forget what is past the window: the table stays small in a daemon that runs for weeks.
                    for old in [k for k, t in self._sent.items() if now - t >= self.throttle_seconds]:
                        del self._sent[old]
                    self._sent[key] = now
                    self._fresh.append(_Message(facts, title, body, urls, tags))
                    self._lock.notify_all()
            # Log outside the lock: the log callable may be slow.
            if closed:
                self._say(f"notifier: closed; dropped the '{facts.event}' notification for job {facts.job_id}", urls)
            elif duplicate:
                self._say(
                    f"notifier: suppressed duplicate '{facts.event}' notification for job {facts.job_id} "
                    f"(same summary {now - last:.0f}s ago; throttle {self.throttle_seconds:.0f}s)",
                    urls,
                )
            return not (closed or duplicate)
        except Exception as error:  # never let a notification take the daemon down
            job = getattr(facts, "job_id", "?")
            self._say(f"notifier: could not queue a notification for job {job}: {error!r}", urls)
            return False

    def flush(self, timeout: float) -> bool:
        """Wait until nothing is queued, in flight or waiting for a retry; True if drained."""
        with self._lock:
            return self._lock.wait_for(lambda: not (self._fresh or self._retries or self._busy), timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker thread and join it. Messages queued but not yet tried get their
        first try within ``timeout``; pending retries (and anything left when the timeout
        runs out) are logged as dropped."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._say(f"notifier: the delivery thread is still sending after {timeout:g}s; leaving it behind")
        with self._lock:
            fresh, self._fresh = list(self._fresh), deque()
            retries, self._retries = sorted(self._retries, key=lambda entry: entry[:2]), []
            self._lock.notify_all()
        for message in fresh:
            self._say(f"notifier: dropped the {message.what} at shutdown (not sent)", message.urls)
        for _, _, delivery in retries:
            self._say(
                f"notifier: dropped the {delivery.message.what} to {delivery.label} at shutdown "
                f"(failed {delivery.tries} time(s), retry pending)",
                delivery.secrets,
            )

    # -- the worker thread --

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    # A new message goes before a due retry: a dead server must not delay
                    # the first try of anything else. Closing still sends the first tries
                    # of what is queued (a job that failed just before shutdown is news),
                    # within close()'s timeout, but no more retries.
                    if self._fresh:
                        item: _Message | _Delivery = self._fresh.popleft()
                        break
                    if self._closing:
                        return
                    if self._retries and self._retries[0][0] <= time.monotonic():
                        item = heapq.heappop(self._retries)[2]
                        break
                    self._lock.wait(self._retries[0][0] - time.monotonic() if self._retries else None)
                self._busy += 1
            try:
                if isinstance(item, _Message):
                    for delivery in self._deliveries(item):
                        self._attempt(delivery)
                else:
                    self._attempt(item)
            except Exception as error:  # keep the thread alive whatever happens
                self._say(f"notifier: internal error while sending: {error!r}", self._all_urls(item))
            finally:
                with self._lock:
                    self._busy -= 1
                    self._lock.notify_all()

    def _deliveries(self, message: _Message) -> list[_Delivery]:
        """The servers one message goes to: the configured ones its tags select, then the
        job's own URLs (a URL in both gets the message once)."""
        job = message.facts.job_id
        deliveries: list[_Delivery] = []
        seen: set[str] = set()
        with captured_warnings():
            selected = list(self._global.find(tag=list(message.tags) or None))
        for service in selected:
            full = service.url()
            if full not in seen:
                seen.add(full)
                deliveries.append(_Delivery(message, service, redact_url(full), (full,)))
        for url in message.urls:
            with captured_warnings() as problems:
                try:
                    service = apprise.Apprise.instantiate(url, asset=self._asset)
                except Exception as error:
                    problems.append(repr(error))
                    service = None
            if service is None:
                if (job, url) not in self._told_bad_url:
                    self._told_bad_url.add((job, url))
                    why = "; ".join(p.rstrip(".") for p in problems) or "apprise does not accept it"
                    self._say(
                        f"notifier: job {job}'s notification URL {redact_url(url)} is not usable: {why}; "
                        f"fix [notify] urls in the job file (see https://appriseit.com/services/)",
                        [url],
                    )
                continue
            full = service.url()
            if full not in seen:
                seen.add(full)
                deliveries.append(_Delivery(message, service, redact_url(url), (url, full)))
        if not deliveries and job not in self._told_no_target:
            self._told_no_target.add(job)
            tags = f" with tags {', '.join(message.tags)}" if message.tags else " untagged"
            self._say(
                f"notifier: no notification target for job {job} ({message.facts.job_name}): no{tags} server "
                f"in the apprise configuration and no [notify] urls in the job file; its notifications are not sent"
            )
        return deliveries

    def _attempt(self, delivery: _Delivery) -> None:
        """Try one delivery once; on failure schedule the next retry or give up."""
        delivery.tries += 1
        message = delivery.message
        with captured_warnings() as problems:
            try:
                sender = apprise.Apprise(delivery.service, asset=self._asset)
                with sender.notify(
                    body=message.body,
                    title=message.title,
                    notify_type=_NOTIFY_TYPES.get(message.facts.event, apprise.NotifyType.INFO),
                    body_format=apprise.NotifyFormat.TEXT,
                ) as result:
                    ok = bool(result)
            except Exception as error:
                problems.append(repr(error))
                ok = False
        if ok:
            return
        why = "; ".join(dict.fromkeys(p.rstrip(".") for p in problems)) or "the server did not accept it"
        total = len(self.retry_delays) + 1
        if delivery.tries <= len(self.retry_delays):
            delay = self.retry_delays[delivery.tries - 1]
            self._say(
                f"notifier: sending the {message.what} to {delivery.label} failed "
                f"(try {delivery.tries} of {total}): {why}; retrying in {delay:g}s",
                delivery.secrets,
            )
            with self._lock:
                heapq.heappush(self._retries, (time.monotonic() + delay, next(self._seq), delivery))
                self._lock.notify_all()
        else:
            self._say(
                f"notifier: gave up sending the {message.what} to {delivery.label} "
                f"after {delivery.tries} tries: {why}",
                delivery.secrets,
            )

    # -- helpers --

    def _all_urls(self, item: object) -> tuple[str, ...]:
        if isinstance(item, _Delivery):
            return item.secrets
        return (item.urls if isinstance(item, _Message) else ()) + self._global_urls

    def _say(self, line: str, urls: Iterable[str] = ()) -> None:
        """Log one line with every URL it may contain redacted; a broken log callable must
        not break delivery."""
        with contextlib.suppress(Exception):
            self._log(escape(redact_text(line, [*urls, *self._global_urls])))
