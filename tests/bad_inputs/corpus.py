"""The bad-input corpus: manifest.toml here, read into :class:`Case` objects that make their
input on disk. Used by tests/e2e/test_bad_inputs.py; a benchmark can iterate it the same way::

    from tests.bad_inputs.corpus import load_cases
    for case in load_cases():
        path = case.make(folder)            # the input, named case.file_name, in folder
        ...                                 # submit it / rename it into the inbox / ...

Standard library only, so a script can use it without the test fixtures. Cases that need
other users (``needs = "root"``) take their accounts in ``make(folder, accounts=...)``: a
mapping of "alice"/"bob" to objects with ``uid`` and ``gid``.
"""

from __future__ import annotations

import gzip
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.jobs_helpers import TINY_JOB

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HERE = Path(__file__).parent
MANIFEST = HERE / "manifest.toml"
BAD_JOBS = HERE.parent / "bad_jobs"

# A job file that passes validation (what links point to: the link, not the job, is the problem).
VALID_JOB = TINY_JOB.format(name="linked-job", batch_size=4, max_steps=2, checkpoint_every_steps=1, keep_checkpoints=2)


@dataclass(frozen=True)
class Case:
    """One bad input: what it is, where it goes and what oomguard must answer."""

    name: str
    category: str
    targets: tuple[str, ...]
    expect: str
    make_how: str | None = None
    file_name: bytes = b""
    exit: int | None = None
    text: str | None = None
    data_file: str | None = None
    size: int = 0
    fill: str | None = None
    link_to: str | None = None
    owner: str | None = None
    link_owner: str | None = None
    mode: int | None = None
    user: str | None = None
    args: tuple[str, ...] = ()
    path: str | None = None
    error_prefix: str | None = None
    answered: bool = False
    needs: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_toml(cls, data: Mapping[str, Any]) -> Case:
        if "as_hex" in data:
            name = bytes.fromhex(data["as_hex"])
        else:
            name = os.fsencode(data.get("as", data["name"] + ".toml"))
        return cls(
            name=data["name"], category=data["category"], targets=tuple(data["targets"]), expect=data["expect"],
            make_how=data.get("make"), file_name=name, exit=data.get("exit"), text=data.get("text"),
            data_file=data.get("file"), size=int(data.get("size", 0)), fill=data.get("fill"), link_to=data.get("link_to"),
            owner=data.get("owner"), link_owner=data.get("link_owner"), mode=int(data["mode"], 8) if "mode" in data else None,
            user=data.get("user"), args=tuple(data.get("args", ())), path=data.get("path"), error_prefix=data.get("error_prefix"),
            answered=bool(data.get("answered", False)), needs=data.get("needs"), raw=data,
        )

    @property
    def shown_name(self) -> str:
        return os.fsdecode(self.file_name)

    def expected(self, **ids: Any) -> str:
        """``expect`` with {alice_job} and {finished_job} filled in."""
        return _fill(self.expect, ids)

    def command_line(self, **ids: Any) -> list[str]:
        return [_fill(a, ids) for a in self.args]

    def make(self, folder: Path, accounts: Mapping[str, Any] | None = None, **ids: Any) -> Path:
        """Make the input in ``folder`` (named ``file_name``) and return its path."""
        if self.make_how is None:
            raise ValueError(f"{self.name}: a command line, not a file (no make = ...)")
        if self.make_how == "path":
            assert self.path is not None
            return Path(self.path)
        target = os.path.join(os.fsencode(folder), self.file_name)
        how = self.make_how
        if how == "missing":
            return Path(os.fsdecode(target))
        if how == "file":
            assert self.data_file is not None
            _write(target, (HERE / self.data_file).read_bytes())
        elif how == "text":
            assert self.text is not None
            _write(target, _fill(self.text, ids).encode("utf-8"))
        elif how == "vanish":
            _write(target, (self.text or "").encode("utf-8"))
        elif how == "big_file":
            _write_big(target, self.size, self.fill)
        elif how == "big_string":
            _write(target, b'name = "' + b"a" * self.size + b'"\ntrainer = "unconditional"\n')
        elif how == "big_list":
            rungs = ", ".join(['"allocator"'] * self.size)
            _write(target, f"{VALID_JOB}\n[ladder]\nallow = [{rungs}]\n".encode())
        elif how == "many_tables":
            _write(target, "".join(f"[t{n}]\nk = {n}\n" for n in range(self.size)).encode())
        elif how == "sparse":
            with open(target, "wb") as handle:
                handle.truncate(self.size)
        elif how == "nul_bytes":
            _write(target, b"\x00" * self.size)
        elif how == "gzip":
            _write(target, gzip.compress(VALID_JOB.encode(), mtime=0))
        elif how == "elf":
            _write(target, b"\x7fELF\x02\x01\x01" + b"\x00" * 57)
        elif how == "symlink":
            link_to = self.link_to or "missing"
            if link_to == "job":
                original = _original(folder, self.file_name)
                _write(original, VALID_JOB.encode())
                self._chown(original, self.link_owner, accounts)
                link_to = os.fsdecode(original)
            elif link_to == "missing":
                link_to = os.path.join(os.fsdecode(folder), "no-such-file-" + self.name)
            os.symlink(link_to, target)
        elif how == "hard_link":
            original = _original(folder, self.file_name)
            _write(original, VALID_JOB.encode())
            self._chown(original, self.link_owner, accounts)
            os.link(original, target)
        elif how == "fifo":
            os.mkfifo(target)
        elif how == "socket":
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.bind(target)
            finally:
                server.close()  # the socket file stays; opening it fails (ENXIO) either way
        elif how == "directory":
            os.mkdir(target)
        else:
            raise ValueError(f"{self.name}: unknown recipe {how!r}")
        if self.mode is not None:
            os.chmod(target, self.mode)
        self._chown(target, self.owner, accounts)
        return Path(os.fsdecode(target))

    def _chown(self, path: bytes | str, owner: str | None, accounts: Mapping[str, Any] | None) -> None:
        if owner is None:
            return
        if owner.startswith("uid:"):
            uid = gid = int(owner[4:])
        else:
            if accounts is None:
                raise ValueError(f"{self.name}: needs the accounts (owner {owner})")
            uid, gid = accounts[owner].uid, accounts[owner].gid
        os.lchown(path, uid, gid)


def _fill(text: str, ids: Mapping[str, Any]) -> str:
    for key, value in ids.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def _original(folder: Path, name: bytes) -> bytes:
    return os.path.join(os.fsencode(folder), b"original-" + name)


def _write(path: bytes | str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


def _write_big(path: bytes | str, size: int, fill: str | None) -> None:
    """``size`` bytes: ``fill`` repeated, or comment lines of a TOML file."""
    chunk = (fill.encode() * 65536) if fill else b"# padding, padding, padding, padding, padding, padding, padding\n" * 1024
    with open(path, "wb") as handle:
        left = size
        while left > 0:
            handle.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)


def load_cases() -> list[Case]:
    """Every case of manifest.toml, in its order."""
    cases = [Case.from_toml(entry) for entry in tomllib.loads(MANIFEST.read_text(encoding="utf-8"))["case"]]
    names = [case.name for case in cases]
    duplicates = {name for name in names if names.count(name) > 1}
    if duplicates:
        raise ValueError(f"{MANIFEST}: case names used twice: {', '.join(sorted(duplicates))}")
    return cases


def bad_job_files() -> list[Path]:
    """The malformed job files of tests/bad_jobs (each starts with its '# expect:' line)."""
    return sorted(BAD_JOBS.glob("*.toml"))


def bad_job_expectation(path: Path) -> str:
    first_line = path.read_text(encoding="utf-8", errors="replace").splitlines()[0]
    if not first_line.startswith("# expect: "):
        raise ValueError(f"{path.name} lacks its '# expect:' line")
    return first_line[len("# expect: "):]
