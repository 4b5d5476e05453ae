"""What goes into the spool's inbox, and how (the CLI's side of the spool; the daemon's watcher is
spool.py).

``oomguard submit`` writes a job file into the inbox under a hidden temporary name and renames
it, so the daemon never reads half a file; it also puts a first line ``# oomguard-base-dir: DIR``
in the copy, so relative paths in the job still mean what they meant next to the original file,
and a second, ``# oomguard-submit-dir: DIR``, the folder it ran in: a command job without
``[command] cwd`` runs there (:func:`spool_text` writes them, :func:`parse_spooled` reads them).
``oomguard cancel`` writes a request (:func:`request_text`) the same way.

Every name carries 128 random bits, and neither the temporary nor the final name may exist
already (:func:`write_to_inbox`); spool.py says why.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

from oomguard.jobs.spec import JobSpec, parse_job_text
from oomguard.strategies.errors import InboxNameTaken, JobFileError

# The first header line: the folder of the job file, which its relative paths are relative to.
BASE_DIR_HEADER = "# oomguard-base-dir: "
# The second header line: the folder `oomguard submit` ran in, where a command job without
# [command] cwd runs (as sbatch and pueue run theirs).
SUBMIT_DIR_HEADER = "# oomguard-submit-dir: "
# Job ids are SQLite integers.
_MAX_JOB_ID = 2**63 - 1


def job_key_problem(job: str) -> str | None:
    """Why ``job`` (an id or a name) cannot name any job, or None. A string of digits is an id
    and must be an ASCII number SQLite can hold: "99999999999999999999" raised OverflowError and
    "\u00b2" (a digit to str.isdigit) ValueError in the store, not "no such job"."""
    if job.isdigit() and not (job.isascii() and len(job) <= 19 and int(job) <= _MAX_JOB_ID):
        return f"no job {job!r}: a job id is a whole number from 1 to {_MAX_JOB_ID} in ASCII digits; `oomguard status` lists the jobs"
    return None


def spool_text(job_file: Path, submit_dir: Path) -> str:
    """The inbox copy of a job file: its text under a header naming its folder and the folder
    it is submitted from."""
    return f"{BASE_DIR_HEADER}{job_file.resolve().parent}\n{SUBMIT_DIR_HEADER}{submit_dir}\n{job_file.read_text(encoding='utf-8')}"


def _header_folder(text: str, header: str, display_name: str) -> tuple[Path | None, str]:
    """The folder a header line of ``text`` names (None without the line), and the text after
    it. A header written by hand: "~nosuchuser" (RuntimeError) or a NUL (ValueError) in it
    escaped as errors other than JobFileError."""
    if not text.startswith(header):
        return None, text
    # The line is dropped: `oomguard submit` added it, so without it line numbers in TOML
    # errors match the user's file.
    line, _, rest = text.partition("\n")
    folder = Path(line[len(header):].strip())
    if not folder.is_absolute() or "\x00" in str(folder):
        raise JobFileError(display_name, None, f"its header line {line[:200]!r} must name an absolute folder (`oomguard submit` writes it); remove the line")
    return folder, rest


def parse_spooled(
    path: Path, display_name: str | None = None, text: str | None = None, *, check_files: bool = True, home: str | None = None,
) -> JobSpec:
    """Validate an inbox file (or its ``text``, read already); errors name the job by
    ``display_name`` (the user's file name). ``check_files``: also look at the paths it names.
    ``home``: the home of the file's owner, which ``~`` in it stands for."""
    if text is None:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise JobFileError(display_name or path.name, None, f"not valid UTF-8 text ({error.reason})") from None
    # The header lines are dropped so that line numbers in TOML errors match the user's file.
    name = display_name or path.name
    base_dir, text = _header_folder(text, BASE_DIR_HEADER, name)
    submit_dir, text = _header_folder(text, SUBMIT_DIR_HEADER, name)
    return parse_job_text(text, name, base_dir=base_dir or path.parent, check_files=check_files, submit_dir=submit_dir, home=home)


def request_text(action: str, job: str) -> str:
    return json.dumps({"action": action, "job": job})


# How many fresh names `oomguard submit`/`cancel` tries when a name it drew is taken already
# (with 128 random bits, a second try only ever happens to a name someone made on purpose).
NAME_TRIES = 5


def unguessable_token() -> str:
    """128 random bits in hex: what makes an inbox name impossible for another user to foresee."""
    return secrets.token_hex(16)


def write_to_inbox(inbox: Path, stem: str, text: str, suffix: str = ".toml") -> Path:
    """Atomically place ``text`` in the inbox under a new unguessable name; returns its final path.
    The file is readable by its owner only.

    Neither the temporary name nor the final one may exist already: the temporary file is made
    with O_CREAT|O_EXCL|O_NOFOLLOW (a file or link someone put there is never opened, written or
    followed) and renamed without replacing anything (renameat2 RENAME_NOREPLACE). A name that
    is taken makes it draw another one (InboxNameTaken after NAME_TRIES)."""
    # The user's file name is only a hint in the name: kept to safe characters and short
    # (a 250-character file name made the temporary name too long: OSError in `submit`).
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", stem)[:100].lstrip(".") or "job"
    for _ in range(NAME_TRIES):
        token = unguessable_token()
        temporary = inbox / f".{token}.tmp"
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        renamed = False
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(text)
            final = inbox / f"{stem}-{token}{suffix}"
            try:
                rename_no_replace(temporary, final)
            except FileExistsError:
                continue
            renamed = True
            return final
        finally:
            if not renamed:  # a failed write or a taken final name: our temporary file goes
                os.unlink(temporary)
    raise InboxNameTaken(errno.EEXIST, f"{NAME_TRIES} fresh names in a row were taken already", str(inbox))


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


@functools.cache
def _renameat2() -> Any:
    """The C library's renameat2 (glibc 2.28 and later), or None."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None


def rename_no_replace(source: Path, target: Path) -> None:
    """rename(2) that raises FileExistsError rather than replace whatever is at ``target``:
    renameat2 with RENAME_NOREPLACE where the C library and the file system have it, else a look
    first (a name of 128 random bits leaves nobody time to make it in between)."""
    renameat2 = _renameat2()
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        number = ctypes.get_errno()
        if number not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(number, os.strerror(number), str(source), None, str(target))
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    os.rename(source, target)
