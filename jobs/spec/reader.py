"""Reading a job file's tables: the one error type, the context a file is read in, the
typed getters of one table (Section), and the small helpers that write values into messages.

Every check in the other modules of this package reports through here, so every message has
the same shape: ``{path}: {key}: {problem}``, naming the value as TOML would write it.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from oomguard.jobs.spec.keys import COMMAND_TRAINER, NOT_FOR_COMMAND_JOBS, SECTION_KEYS, SPECIAL_HINTS, section_keys
from oomguard.strategies.errors import JobFileError



class ReadContext:
    """Where and how one job file is read: its name in messages (``path``), the folder its
    relative paths start from, whether the files and folders it names are looked at, and
    where a command job without [command] cwd runs."""

    def __init__(self, path: str, base_dir: Path, check_files: bool, submit_dir: Path | None = None, home: str | None = None) -> None:
        self.path = path
        self.base_dir = base_dir
        self.check_files = check_files
        self.submit_dir = submit_dir
        self.home = home
        # Set from the job's trainer before any table is read: a command job may use fewer
        # keys, a text-to-image job other ones.
        self.trainer: str | None = None

    @property
    def command_job(self) -> bool:
        return self.trainer == COMMAND_TRAINER

    def fail(self, key: str | None, problem: str) -> JobFileError:
        return JobFileError(self.path, key, problem)


# The default of a required key: its absence is the problem.
MISSING: Any = object()


def strip_none(data: Any) -> Any:
    """Drop None values (to_dict's 'absent') from a mapping and its sub-mappings."""
    if not isinstance(data, Mapping):
        return data
    return {k: strip_none(v) for k, v in data.items() if v is not None}


def render_value(value: Any, limit: int = 60) -> str:
    """A value as it would be written in TOML, shortened."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = "nan" if math.isnan(value) else ("inf" if value == math.inf else "-inf" if value == -math.inf else repr(value))
    elif isinstance(value, int):
        text = str(value)
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(render_value(v, limit) for v in value) + "]"
    elif isinstance(value, Mapping):
        text = "a table"
    elif hasattr(value, "isoformat"):
        text = value.isoformat()
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_value(value: Any) -> str:
    """A value of the wrong type: its TOML type, then the value."""
    if isinstance(value, bool):
        return f"a boolean ({render_value(value)})"
    if isinstance(value, int):
        return f"an integer ({render_value(value)})"
    if isinstance(value, float):
        return f"a float ({render_value(value)})"
    if isinstance(value, str):
        return f"a string ({render_value(value)})"
    if isinstance(value, (list, tuple)):
        return f"a list ({render_value(value)})"
    if isinstance(value, Mapping):
        return "a table"
    if hasattr(value, "isoformat"):
        return f"a date/time ({render_value(value)})"
    return f"a {type(value).__name__} ({render_value(value)})"


def one_of(choices: Sequence[str]) -> str:
    return ", ".join(f'"{c}"' for c in choices)


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    lowered = {c.lower(): c for c in choices}
    if word.lower() in lowered:
        return f"; did you mean '{lowered[word.lower()]}'?"
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Section:
    """One table of the job file, read key by key with typed getters."""

    def __init__(self, ctx: ReadContext, name: str | None, raw: Any) -> None:
        self.ctx = ctx
        self.name = name
        if not isinstance(raw, Mapping):
            raise ctx.fail(name, f"expected a table ([{name}]), found {describe_value(raw)}")
        self.raw = raw
        allowed = section_keys(name, ctx.trainer)
        if allowed is not None:
            self._check_unknown(allowed)

    def _check_unknown(self, allowed: tuple[str, ...]) -> None:
        # A command job's keys the built-in trainer alone has are refused one by one, with a
        # reason, once the table is read; they are never offered as what a key should be.
        explained = NOT_FOR_COMMAND_JOBS.get(self.name, ()) if self.ctx.command_job else ()
        allowed = tuple(key for key in allowed if key not in explained)
        for key in self.raw:
            if key in allowed or key in explained:
                continue
            hint = self._hint(str(key), allowed)
            listed = ", ".join(sorted(allowed))
            raise self.ctx.fail(self.key(str(key)), f"unknown key (expected one of: {listed}){hint}")

    def _hint(self, key: str, allowed: tuple[str, ...]) -> str:
        if key in SPECIAL_HINTS and self.name == "model":
            return f"; {SPECIAL_HINTS[key]}"
        close = did_you_mean(key, allowed)
        if close:
            return close
        for other, keys in SECTION_KEYS.items():
            if other != self.name and key in keys:
                if other is None:
                    return f"; '{key}' is a top-level key: put it above the first [table] header"
                return f"; '{key}' belongs in [{other}]"
        return ""

    def key(self, k: str) -> str:
        return f"{self.name}.{k}" if self.name else k

    def fail(self, k: str, problem: str) -> JobFileError:
        return self.ctx.fail(self.key(k), problem)

    def get(self, k: str, default: Any) -> Any:
        if k in self.raw:
            return self.raw[k]
        if default is MISSING:
            raise self.fail(k, "required key is missing")
        return default

    def has(self, k: str) -> bool:
        return k in self.raw

    def int(self, k: str, *, minimum: int | None = None, maximum: int | None = None, default: Any = MISSING) -> Any:
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        if minimum is not None and maximum is not None:
            want = f"an integer in {minimum}..{maximum}"
        elif minimum is not None:
            want = f"an integer >= {minimum}"
        else:
            want = "an integer"
        if not is_int(value):
            raise self.fail(k, f"expected {want}, found {describe_value(value)}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise self.fail(k, f"expected {want}, found {render_value(value)}")
        return value

    def number(
        self,
        k: str,
        *,
        gt: float | None = None,
        ge: float | None = None,
        lt: float | None = None,
        default: Any = MISSING,
    ) -> Any:
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        if ge is not None and lt is not None:
            want = f"a number in [{ge:g}, {lt:g})"
        elif gt is not None and lt is not None:
            want = f"a number in ({gt:g}, {lt:g})"
        elif gt is not None:
            want = f"a number > {gt:g}"
        elif ge is not None:
            want = f"a number >= {ge:g}"
        else:
            want = "a number"
        if not is_number(value):
            raise self.fail(k, f"expected {want}, found {describe_value(value)}")
        ok = math.isfinite(value)
        ok = ok and (gt is None or value > gt) and (ge is None or value >= ge) and (lt is None or value < lt)
        if not ok:
            raise self.fail(k, f"expected {want}, found {render_value(value)}")
        return float(value)

    def bool(self, k: str, default: Any = MISSING) -> Any:
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        if not isinstance(value, bool):
            raise self.fail(k, f"expected true or false, found {describe_value(value)}")
        return value

    def str(self, k: str, default: Any = MISSING) -> Any:
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        if not isinstance(value, str):
            raise self.fail(k, f"expected a string, found {describe_value(value)}")
        if not value:
            raise self.fail(k, 'expected a non-empty string, found ""')
        return value

    def choice(self, k: str, choices: Sequence[str], default: Any = MISSING) -> Any:
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        if not isinstance(value, str):
            raise self.fail(k, f"expected one of {one_of(choices)}, found {describe_value(value)}")
        if value not in choices:
            hint = did_you_mean(value, choices)
            raise self.fail(k, f"expected one of {one_of(choices)}, found {render_value(value)}{hint}")
        return value

    def names(self, k: str, choices: Sequence[str], what: str, default: Any = MISSING) -> Any:
        """A list of unique names from ``choices``, e.g. ladder.allow."""
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        want = f"a list of {what} names"
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(k, f"expected {want}, found {describe_value(value)}")
        seen: set[str] = set()
        for v in value:
            if v not in choices:
                hint = did_you_mean(v, choices)
                raise self.fail(k, f"unknown {what} '{v}' (expected one of: {', '.join(choices)}){hint}")
            if v in seen:
                raise self.fail(k, f"{what} '{v}' is listed twice")
            seen.add(v)
        return tuple(value)

    def required_table(self, k: str) -> Section:
        table = self.table(k, required=True)
        assert table is not None  # table() raises when a required one is missing
        return table

    def table(self, k: str, *, required: bool) -> Section | None:
        if k not in self.raw:
            if required:
                raise self.fail(k, f"required table [{self.key(k)}] is missing")
            return None
        return Section(self.ctx, self.key(k), self.raw[k])


def resolve_path(ctx: ReadContext, text: str, key: str) -> Path:
    """``text``, a path in the job file at ``key``, made absolute: ``~`` is the home of the
    job's owner, a relative path starts at the job file's folder."""
    # A NUL (ValueError), "~nosuchuser" (RuntimeError) and a name longer than the file system
    # allows (OSError) used to escape as exceptions other than JobFileError.
    if "\x00" in text:
        raise ctx.fail(key, "contains a NUL character (\\u0000), which no path can hold; remove it")
    try:
        # "~" is the home of the job's owner (ctx.home; the daemon, root, parses others' files),
        # never that of whoever parses.
        p = Path(ctx.home + text[1:]) if ctx.home and (text == "~" or text.startswith("~/")) else Path(text).expanduser()
    except RuntimeError:
        raise ctx.fail(key, f"cannot expand {render_value(text)}: no such user's home directory; give the full path") from None
    if not p.is_absolute():
        p = ctx.base_dir / p
    if not ctx.check_files:
        # Not looked at: not on the file system as whoever parses (the daemon, root, parsing
        # another user's file, must not follow that user's links, nor store where a link in a
        # folder only root may read points). The job's own processes resolve it, as its owner.
        return p
    try:
        return p.resolve()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the base folder
        raise ctx.fail(key, f"cannot use path {render_value(text)}: {getattr(e, 'strerror', None) or e}") from None
