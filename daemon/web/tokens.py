"""Per-user tokens for the dashboard's TCP port: ``<uid>.<HMAC-SHA256 of the uid>`` under a key
only the server can read (STATE/secrets/web.key, made on first use, 0600). A user gets theirs
from the server over its Unix socket, where the kernel says who they are (`oomguard web-url`);
a token names one uid and cannot be made for another without the key.

The browser keeps a *session* instead, ``<uid>.<issued>.<HMAC of both>``, good for
SESSION_SECONDS: a browser sends a localhost cookie to every port of localhost, another
user's server among them, so what such a server could catch must expire."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

KEY_BYTES = 32
SESSION_SECONDS = 12 * 3600
_MAC_LENGTH = 64  # hex digits of an HMAC-SHA256


class Tokens:
    def __init__(self, key_path: Path) -> None:
        self.key = _load_or_create(key_path)

    def token_for(self, uid: int) -> str:
        return f"{uid}.{self._mac(str(uid))}"

    def uid_of(self, token: str) -> int | None:
        """The uid a token was made for; None for anything else (compared in constant time)."""
        uid_text, _, mac = token.partition(".")
        uid = _uid(uid_text)
        return uid if uid is not None and _hex(mac) and hmac.compare_digest(mac, self._mac(str(uid))) else None

    def session_for(self, uid: int, now: float) -> str:
        issued = str(int(now))
        return f"{uid}.{issued}.{self._mac(f'{uid}.{issued}')}"

    def uid_of_session(self, session: str, now: float) -> int | None:
        """The uid of a session made less than SESSION_SECONDS ago; None for anything else."""
        uid_text, _, rest = session.partition(".")
        issued, _, mac = rest.partition(".")
        uid = _uid(uid_text)
        if uid is None or not issued.isascii() or not issued.isdigit() or len(issued) > 12 or not _hex(mac):
            return None
        if not 0 <= now - int(issued) < SESSION_SECONDS:
            return None
        return uid if hmac.compare_digest(mac, self._mac(f"{uid}.{issued}")) else None

    def _mac(self, text: str) -> str:
        return hmac.new(self.key, text.encode(), hashlib.sha256).hexdigest()


def _uid(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 10 else None


def _hex(text: str) -> bool:
    """An HMAC's hex digits, as made here (compare_digest refuses non-ASCII text with TypeError)."""
    return len(text) == _MAC_LENGTH and all(c in "0123456789abcdef" for c in text)


def _load_or_create(path: Path) -> bytes:
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = secrets.token_bytes(KEY_BYTES)
        # O_EXCL: two servers starting at once do not each write a key the other's tokens miss.
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_bytes()
        with os.fdopen(descriptor, "wb") as file:
            file.write(key)
    if len(key) < KEY_BYTES:
        raise ValueError(f"{path} holds {len(key)} bytes, not a key of {KEY_BYTES}; remove it and start `oomguard serve` again (every user's link changes)")
    return key
