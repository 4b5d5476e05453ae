"""Reading a job file: the bytes (a regular file, at most MAX_JOB_FILE_BYTES), the text
(UTF-8, no NUL), then the TOML, each problem a :class:`JobFileError` of its own; the job in
it is then read table by table (job.py parse_job).

The entry points of intake, the one place a spec is validated: :func:`load_job_file` for a
file named on the command line, :func:`parse_job_text` for text the spool has read.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from oomguard.jobs.spec.job import JobSpec, parse_job
from oomguard.jobs.spec.reader import ReadContext
from oomguard.strategies.errors import JobFileError

# A job file is a few hundred bytes; the spool reads at most this much of one (plus the header
# line `submit` adds: daemon/spool.py READ_LIMIT), so `oomguard submit` refuses a bigger file
# instead of placing one the daemon would reject, and never reads /dev/zero until memory runs out.
MAX_JOB_FILE_BYTES = 1 << 20


def load_job_file(path: str | os.PathLike[str], submit_dir: Path | None = None) -> JobSpec:
    """Read and validate a job file. Relative paths inside it are resolved against its folder;
    a command job without [command] cwd runs in ``submit_dir``, the folder it is submitted
    from (by default the current one), as sbatch and pueue run theirs.

    Raises :class:`JobFileError` for every problem, including unreadable files.
    """
    display = os.fspath(path)
    p = Path(path)
    if p.is_dir():
        raise JobFileError(display, None, "is a directory, not a job file")
    try:
        # A FIFO would block the read until someone writes, and /dev/zero never ends: only a
        # regular file is read, and at most MAX_JOB_FILE_BYTES of it.
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            raise JobFileError(display, None, "is not a regular file (a FIFO, device or socket); give the path of a job file (TOML)")
        if st.st_size > MAX_JOB_FILE_BYTES:
            raise JobFileError(display, None, _too_big(st.st_size))
        with open(p, "rb") as handle:
            raw = handle.read(MAX_JOB_FILE_BYTES + 1)
        if len(raw) > MAX_JOB_FILE_BYTES:
            raise JobFileError(display, None, _too_big(len(raw)))
    except JobFileError:
        raise
    except FileNotFoundError:
        raise JobFileError(display, None, "job file not found") from None
    except PermissionError:
        raise JobFileError(display, None, "cannot read job file: permission denied") from None
    except OSError as e:
        raise JobFileError(display, None, f"cannot read job file: {e.strerror or e}") from None
    except ValueError:  # a NUL in the path
        raise JobFileError(display, None, "job file not found (the path contains a NUL character)") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        problem = f"not valid UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}); save the job file as UTF-8"
        raise JobFileError(display, None, problem) from None
    absolute = p.expanduser().resolve()
    ctx = ReadContext(display, absolute.parent, check_files=True, submit_dir=submit_dir or _current_folder())
    return _parse_text(ctx, text, str(absolute))


def _current_folder() -> Path | None:
    """The folder this process is in; None when it was removed under it."""
    try:
        return Path.cwd()
    except OSError:
        return None


def _too_big(size: int) -> str:
    return (
        f"is {size} bytes; a job file may have at most {MAX_JOB_FILE_BYTES} (1 MiB): "
        "keep data, models and long lists in the files and folders it names"
    )


def parse_job_text(
    text: str,
    path: str | os.PathLike[str],
    base_dir: str | os.PathLike[str] | None = None,
    *,
    check_files: bool = True,
    submit_dir: Path | None = None,
    home: str | None = None,
) -> JobSpec:
    """Validate job-file text. ``path`` names the file in messages (and becomes
    ``source_path``); relative paths are resolved against ``base_dir``, by default the
    folder of ``path``. ``check_files``: also look at the files and folders it names (the
    data folder, the command's folder, program and script). ``submit_dir``: where a command
    job without [command] cwd runs (the folder it was submitted from); None: its workdir.
    ``home``: what ``~`` stands for, the home of the job's owner (None: whoever parses)."""
    display = os.fspath(path)
    base = Path(base_dir) if base_dir is not None else Path(display).parent
    ctx = ReadContext(display, base.expanduser().absolute(), check_files=check_files, submit_dir=submit_dir, home=home)
    return _parse_text(ctx, text, display)


def _parse_text(ctx: ReadContext, text: str, source_path: str | None) -> JobSpec:
    if not isinstance(text, str):
        raise ctx.fail(None, f"expected job file text, found {type(text).__name__}")
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        raise ctx.fail(None, "empty job file (expected at least name, trainer, [data], [model] and [train])")
    if "\x00" in text:
        # tomllib names it only as "Illegal character '\x00'"; a NUL is the sign of a binary
        # or UTF-16 file.
        line = text[: text.index("\x00")].count("\n") + 1
        raise ctx.fail(None, f"not a text file: NUL byte on line {line} (binary, or UTF-16; save the job file as UTF-8 text)")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ctx.fail(None, f"not valid TOML: {e}") from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively: [[[[...]]]] a few
        # thousand deep raised RecursionError, which is no JobFileError.
        raise ctx.fail(None, "not valid TOML for a job: arrays or inline tables nested too deeply") from None
    except ValueError as e:
        # int() of an integer of more than 4300 digits (sys.get_int_max_str_digits) raised
        # a plain ValueError inside tomllib.
        if "digits" in str(e):
            raise ctx.fail(None, "not valid TOML for a job: an integer with thousands of digits") from None
        raise ctx.fail(None, f"not valid TOML: {e}") from None
    if not raw:
        raise ctx.fail(None, "empty job file (expected at least name, trainer, [data], [model] and [train])")
    return parse_job(ctx, raw, source_path)
