"""Notification URLs as anyone but the daemon may see them.

Notification URLs carry passwords and tokens, and the daemon's log is read by other people on a
shared box. Every line the notifier logs is passed through ``redact_text`` with every URL it
may contain, and URLs are named by apprise's privacy rendering (``url(privacy=True)``) plus
masking of what apprise prints in clear: path segments (a webhook's token: json://host/SECRET),
HTTP header values and every query value but apprise's plain settings. The store keeps a job's
URLs only in this form (daemon/job_secrets.py).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import apprise

from oomguard.daemon.notify_apprise import apprise_asset, captured_warnings

_MASK = "****"
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
    with captured_warnings():  # apprise logs unparseable URLs in clear; keep that to ourselves
        try:
            plugin = apprise.Apprise.instantiate(url, asset=apprise_asset())
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
