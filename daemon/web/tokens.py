"""Per-user tokens for the dashboard's TCP port: ``<uid>.<HMAC-SHA256 of the uid>`` under a key
only the server can read (STATE/secrets/web.key, made on first use, 0600). A user gets theirs
from the server over its Unix socket, where the kernel says who they are (`oomguard web-url`);
a token names one uid and cannot be made for another without the key."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

KEY_BYTES = 32


class Tokens:
    def __init__(self, key_path: Path) -> None:
        self.key = _load_or_create(key_path)

    def token_for(self, uid: int) -> str:
        return f"{uid}.{self._mac(uid)}"

    def uid_of(self, token: str) -> int | None:
        """The uid a token was made for; None for anything else (compared in constant time)."""
        uid_text, _, mac = token.partition(".")
        if not uid_text.isascii() or not uid_text.isdigit() or len(uid_text) > 10:
            return None
        uid = int(uid_text)
        return uid if hmac.compare_digest(mac, self._mac(uid)) else None

    def _mac(self, uid: int) -> str:
        return hmac.new(self.key, str(uid).encode(), hashlib.sha256).hexdigest()


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
