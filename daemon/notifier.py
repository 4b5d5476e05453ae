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
- Redaction: notification URLs carry passwords and tokens, and the daemon's log is read
  by other people on a shared box. Every line this module logs is passed through
  ``redact_text`` with every URL it may contain, and URLs are named by apprise's privacy
  rendering (``url(privacy=True)``) plus masking of what apprise prints in clear: path
  segments (a webhook's token: json://host/SECRET), HTTP header values and every query value
  but apprise's plain settings. Lines are escaped (daemon/text.py): an error message a
  server sends back cannot add a line of its own to the log.
- Apprise's own log records (from the threads that call into apprise here) are caught by
  a filter on the ``apprise`` logger: warnings and errors become part of our one-line
  reports (redacted), the rest is dropped, so nothing of apprise's reaches stdout or the
  root logger on its own.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import apprise
from apprise.config.file import ConfigFile

from oomguard.daemon.text import escape
from oomguard.jobs.sizes import format_size
from oomguard.jobs.spec import DEFAULT_NOTIFY_EVENTS, NOTIFY_EVENTS

__all__ = [
    "DEFAULT_EVENTS",
    "EVENTS",
    "JobFacts",
    "Notifier",
    "compose",
    "default_config_paths",
    "is_redacted",
    "redact_text",
    "redact_url",
]

# A job file's [notify] events are checked against the same names (jobs/spec.py).
EVENTS = NOTIFY_EVENTS
DEFAULT_EVENTS = DEFAULT_NOTIFY_EVENTS  # escalated is opt-in

CONFIG_HELP = "https://appriseit.com/getting-started/configuration/"

# How the message looks in services that show a colour or an icon for its kind.
_NOTIFY_TYPES = {
    "failed": apprise.NotifyType.FAILURE,
    "finished": apprise.NotifyType.SUCCESS,
    "escalated": apprise.NotifyType.WARNING,
    "stalled": apprise.NotifyType.WARNING,
}

_MASK = "****"


@dataclass(frozen=True)
class JobFacts:
    """What a message says; the daemon fills it."""

    job_id: int
    job_name: str
    user: str
    event: str  # one of EVENTS
    attempts: int
    plan: str  # short plan text, e.g. "mb=4x4 ckpt"
    step: int | None
    max_steps: int | None
    peak_bytes: int | None
    cap_bytes: int | None
    summary: str  # one line: what happened
    next_step: str  # what happens next
    gpus: str = ""  # e.g. "0,1" or "" when none


def compose(facts: JobFacts) -> tuple[str, str]:
    """(title, body) of the message for ``facts``: one line per field, plain text. Each field
    is one line whatever it holds (text.escape): a job's own text (what its runner reported)
    cannot add a line or a terminal escape to the message."""
    name = escape(facts.job_name)
    title = f"oomguard: job {facts.job_id} ({name}) {escape(facts.event)}"
    step = "unknown" if facts.step is None else escape(facts.step)
    if facts.max_steps is not None:
        step += f" of {escape(facts.max_steps)}"
    memory = []
    if isinstance(facts.peak_bytes, (int, float)):
        memory.append(f"peak {format_size(facts.peak_bytes)}")
    if isinstance(facts.cap_bytes, (int, float)):
        memory.append(f"cap {format_size(facts.cap_bytes)}")
    body = "\n".join(
        [
            f"job: {facts.job_id} ({name})",
            f"user: {escape(facts.user)}",
            f"event: {escape(facts.event)}",
            f"attempts: {facts.attempts}",
            f"plan: {escape(facts.plan)}",
            f"step: {step}",
            f"memory: {' of '.join(memory) if memory else 'not measured'}",
            f"GPUs: {escape(facts.gpus) or 'none'}",
            f"what happened: {escape(facts.summary)}",
            f"what next: {escape(facts.next_step)}",
        ]
    )
    return title, body


# --- apprise's log records -------------------------------------------------------------


class _AppriseLogRouter(logging.Filter):
    """A filter on the ``apprise`` logger: records from a thread inside ``_captured()``
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
def _captured() -> Iterator[list[str]]:
    """Collect what apprise warns about in this thread while the block runs."""
    outer = getattr(_ROUTER.local, "sink", None)
    sink: list[str] = []
    _ROUTER.local.sink = sink
    try:
        yield sink
    finally:
        _ROUTER.local.sink = outer


def _asset() -> apprise.AppriseAsset:
    # async_mode=False and service_timeout=0: deliver in the calling thread (our worker)
    # instead of apprise's shared thread pools. Each plugin's socket timeouts still bound
    # a call; the worker is the only thing a hung server can hold up.
    return apprise.AppriseAsset(
        app_id="oomguard", app_desc="oomguard training supervisor", async_mode=False, service_timeout=0
    )


# --- redaction -------------------------------------------------------------------------

_SCHEME_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]*)://")
# Query parameters whose values are secrets even where apprise's privacy mode prints them:
# "-Name" and "+Name" are HTTP headers and GET parameters of json://, xml://, form://.
_SECRET_KEY_RE = re.compile(r"^[-+]|token|key|secret|pass|auth|sig|cred", re.IGNORECASE)
# Query parameters of apprise's own that say how to send, never who to or with what key: their
# values are shown. Every other value is masked (a webhook's ?token=, a payload field, a
# recipient).
_PLAIN_PARAMS = frozenset(
    {
        "album", "avatar", "batch", "blocks", "content", "cto", "detect", "discovery", "emojis", "fields", "footer",
        "footer_logo", "format", "image", "mdv", "method", "mode", "optional", "overflow", "preview", "priority", "retry",
        "rto", "silent", "smtp", "store", "timestamp", "tts", "tz", "verify", "version", "wait",
    }
)


def _mask_query(query: str) -> str:
    """A query string with every value masked but those of _PLAIN_PARAMS."""
    parts = []
    for item in query.split("&"):
        name, eq, _value = item.partition("=")
        plain = unquote(name).lower() in _PLAIN_PARAMS and not _SECRET_KEY_RE.search(unquote(name))
        parts.append(f"{name}={_MASK}" if eq and not plain else item)
    return "&".join(parts)


def _mask_rendered(rendered: str) -> str | None:
    """Apprise's privacy rendering of a URL with what it leaves in clear masked too: every path
    segment (a webhook's token is often its path: json://host/SECRET, ntfy://host/TOPIC), the
    fragment, and every query value but apprise's plain settings. The scheme, user name, host
    and port stay, so that a log line still says which server it means. None when the rendering
    is not a URL."""
    try:
        split = urlsplit(rendered)
    except ValueError:
        return None
    if not split.scheme or not split.netloc:
        return None
    netloc = split.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and split.password is not None:
        netloc = f"{userinfo.partition(':')[0]}:{_MASK}@{host}"  # the login name stays, to tell servers apart
    elif at:
        netloc = f"{_MASK}@{host}"  # a user name without a password is often the token itself (https://TOKEN@host)
    path = "/".join(_MASK if segment else "" for segment in split.path.split("/"))
    query = _mask_query(split.query) if split.query else ""
    return urlunsplit((split.scheme, netloc, path, query, _MASK if split.fragment else ""))


@functools.lru_cache(maxsize=512)
def redact_url(url: str) -> str:
    """The URL as anyone but the daemon may see it: apprise's privacy rendering (passwords and
    the tokens apprise knows of masked, or shortened to their first and last character), with
    every path segment, fragment and query value but apprise's plain settings masked as well
    (``json://host:8080/****?method=POST&...``). A URL apprise cannot parse is reduced to its
    scheme plus '://…' (never returned in clear)."""
    with _captured():  # apprise logs unparseable URLs in clear; keep that to ourselves
        try:
            plugin = apprise.Apprise.instantiate(url, asset=_asset())
            rendered = plugin.url(privacy=True) if plugin is not None else None
        except Exception:  # a plugin's bug must not turn into a secret in a log line
            rendered = None
    masked = _mask_rendered(rendered) if rendered else None
    if masked:
        return masked
    match = _SCHEME_RE.match(url)
    return f"{match.group(1)}://…" if match else "…"


def is_redacted(url: str) -> bool:
    """Whether ``url`` has nothing left that redact_url masks (masking it again changes
    nothing). For forms stored by an older oomguard, which kept webhook paths in clear."""
    return url.endswith("://…") or url == "…" or _mask_rendered(url) == url


def _secret_parts(url: str) -> tuple[list[str], list[str]]:
    """Pieces of ``url`` that may show up alone in an error message: (those masked wherever they
    appear: its password and the values of its query parameters; those masked where they stand
    as a word of their own: its path segments, its fragment, and its host when the redacted
    form does not show it, as for tgram://BOTTOKEN/...)."""
    anywhere: list[str] = []
    words: list[str] = []
    with contextlib.suppress(ValueError):
        split = urlsplit(url.strip())
        if split.password:
            anywhere += [split.password, unquote(split.password)]
        elif split.username:
            anywhere += [split.username, unquote(split.username)]
        for name, value in parse_qsl(split.query):
            if unquote(name).lower() not in _PLAIN_PARAMS or _SECRET_KEY_RE.search(name):
                anywhere.append(value)
        for piece in [*split.path.split("/"), split.fragment]:
            words += [piece, unquote(piece)]
        host = split.hostname or ""
        if host and host not in redact_url(url):
            words += [host, split.netloc.rpartition("@")[2]]
    # Short pieces ("no", "1", "api") would mask ordinary words all over the line.
    return [part for part in anywhere if len(part) >= 4], [part for part in words if len(part) >= 4]


# "scheme://user:password@" anywhere in a text, for URLs nobody told us about (apprise's
# own messages about a bad configuration line keep the first and last character of it).
_USERINFO_RE = re.compile(r"(://[^\s/:@]*:)[^\s/@]+@")


def redact_text(text: str, urls: Iterable[str]) -> str:
    """``text`` with every occurrence of each url replaced by ``redact_url(url)`` (and any
    password, path segment or query value of it that appears on its own masked, as is the
    password of any other ``scheme://user:password@`` in the text)."""
    urls = sorted({url for url in urls if url}, key=len, reverse=True)  # longest first
    for number, url in enumerate(urls):
        if url in text:
            redacted = redact_url(url)
            # The text may hold the redacted form already, which may start with the URL itself
            # (nothing to mask, only apprise's defaults added): set it aside while replacing.
            placeholder = f"\0{number}\0"
            text = text.replace(redacted, placeholder).replace(url, redacted).replace(placeholder, redacted)
    for url in urls:
        anywhere, words = _secret_parts(url)
        for part in sorted(anywhere, key=len, reverse=True):
            text = text.replace(part, _MASK)
        for part in sorted(set(words), key=len, reverse=True):
            text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(part)}(?![A-Za-z0-9])", _MASK, text)
    return _USERINFO_RE.sub(rf"\1{_MASK}@", text)


# --- configuration ---------------------------------------------------------------------


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


def _load_config(path: Path, asset: apprise.AppriseAsset, log: Callable[[str], None]) -> ConfigFile | None:
    """Parse one apprise configuration file now (not at the first message) so a mistake is
    reported when the daemon starts; None when it yields no server at all."""
    if not path.is_file():
        log(
            f"notifier: apprise configuration {path} does not exist (or is not a file); "
            f"create it (see {CONFIG_HELP}) or leave it out of the configuration paths"
        )
        return None
    with _captured() as problems:
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


# --- delivery --------------------------------------------------------------------------


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
        self._asset = _asset()
        self._global = apprise.Apprise(asset=self._asset)
        paths = default_config_paths() if config_paths is None else [Path(p) for p in config_paths]
        for path in paths:
            config = _load_config(path, self._asset, self._log)
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
        with _captured():
            selected = list(self._global.find(tag=list(message.tags) or None))
        for service in selected:
            full = service.url()
            if full not in seen:
                seen.add(full)
                deliveries.append(_Delivery(message, service, redact_url(full), (full,)))
        for url in message.urls:
            with _captured() as problems:
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
        with _captured() as problems:
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
