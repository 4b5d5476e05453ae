"""A job's log with a cap (daemon/log_cap.py): output.log keeps the first bytes, the tail files
the last, the total on disk stays bounded; and what reads a long log reads it whole
(jobs/attempt.py read_log_end, daemon/cli/log_print.py)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import BinaryIO

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.daemon.cli.log_print import AttemptLog
from oomguard.daemon.log_cap import MIN_LOG_LIMIT, CappedLog, check_limit, split_limit
from oomguard.jobs.attempt import LOG, LOG_DROPPED, LOG_TAIL, LOG_TAIL_OLDER, AttemptFiles, read_log_end

MARKER_START = b"oomguard: output.log reached "


def stream(lines: int, start: int = 0) -> bytes:
    """Numbered lines of 24 bytes, each with a two-byte character."""
    return b"".join(f"line {n:08d} \u00e9 xxxxxx\n".encode() for n in range(start, start + lines))


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def split_head(head_file: bytes) -> tuple[bytes, bytes]:
    """output.log as (the output it kept, its marker line)."""
    at = head_file.rfind(MARKER_START)
    assert at >= 0, head_file[-300:]
    return head_file[:at], head_file[at:]


def assert_whole_account(folder: Path, written: bytes, head_bytes: int, tail_bytes: int) -> None:
    """Every byte written is in output.log's head, counted as dropped, or in the tail files, in
    order; and the folder holds no more than the cap, one marker line and the small count."""
    files = files_of(folder)
    head, marker = split_head(files[LOG])
    assert marker.endswith(b"\n") and marker.count(b"\n") == 1 and len(marker) < 300
    dropped = json.loads(files[LOG_DROPPED])["dropped_bytes"] if LOG_DROPPED in files else 0
    tail = files.get(LOG_TAIL_OLDER, b"") + files[LOG_TAIL]
    # A head cut inside a line ends with the newline the marker brought along.
    kept = [h for h in (head, head[:-1] if head.endswith(b"\n") else None) if h is not None and written.startswith(h)]
    assert [h for h in kept if written[len(h) + dropped :] == tail], (len(head), dropped, len(tail), len(written))
    assert len(kept[-1]) <= head_bytes
    segment = tail_bytes // 2
    assert len(files[LOG_TAIL]) <= segment and len(files.get(LOG_TAIL_OLDER, b"")) <= segment
    # The newest output is always there: at least a segment of it (all of it, when less).
    assert len(tail) >= min(segment, len(written) - len(head))
    assert sum(len(data) for data in files.values()) <= head_bytes + tail_bytes + 300 + 40


def test_a_log_under_its_head_is_output_log_alone(tmp_path: Path) -> None:
    with CappedLog(tmp_path, 1000, 4000) as log:
        log.write(stream(10))
        log.write(b"")
    assert files_of(tmp_path) == {LOG: stream(10)}


def test_the_head_keeps_the_first_lines_then_says_where_the_rest_goes(tmp_path: Path) -> None:
    written = stream(1000)
    with CappedLog(tmp_path, 1000, 4000) as log:
        for at in range(0, len(written), 24):
            log.write(written[at : at + 24])
    head, marker = split_head((tmp_path / LOG).read_bytes())
    assert head == stream(41)  # 41 whole lines fit in 1000 bytes
    assert marker.decode() == (
        "oomguard: output.log reached 984 bytes; the rest of the output goes to output.tail.log, renamed to output.tail.log.1 "
        "every 2000 bytes (only the last 2000 to 4000 bytes are kept; `oomguard logs JOB` prints the head and the tail)\n"
    )
    assert len((tmp_path / LOG_TAIL_OLDER).read_bytes()) == 2000
    assert written.endswith((tmp_path / LOG_TAIL).read_bytes())
    assert_whole_account(tmp_path, written, 1000, 4000)


def test_one_huge_write_keeps_the_head_and_the_newest_end(tmp_path: Path) -> None:
    written = stream(50_000)  # 1.2 MB at once, 30 times the tail
    with CappedLog(tmp_path, 1000, 40_000) as log:
        log.write(written)
    assert_whole_account(tmp_path, written, 1000, 40_000)
    assert split_head((tmp_path / LOG).read_bytes())[0] == stream(41)


def test_a_head_without_a_line_end_near_its_end_is_cut_between_characters(tmp_path: Path) -> None:
    written = b"a" * 9 + "\u00e9\u00e9\u00e9".encode() + b"\n"  # the first é spans bytes 9 and 10
    with CappedLog(tmp_path, 10, 100) as log:
        log.write(written[:1])  # the head does not end with a whole line
        log.write(written[1:])
    # Nine bytes, and the marker on a line of its own.
    assert (tmp_path / LOG).read_bytes().startswith(b"a" * 9 + b"\n" + MARKER_START)
    assert (tmp_path / LOG_TAIL).read_bytes() == "\u00e9\u00e9\u00e9\n".encode()


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.integers(min_value=0, max_value=6000), max_size=20), head=st.integers(0, 3000), tail=st.integers(200, 5000))
def test_any_writes_keep_the_head_the_newest_end_and_the_bound(tmp_path_factory: pytest.TempPathFactory, chunks: list[int], head: int, tail: int) -> None:
    folder = tmp_path_factory.mktemp("log")
    written = stream(sum(chunks) // 24 + 1)[: sum(chunks)]
    with CappedLog(folder, head, tail) as log:
        at = 0
        for size in chunks:
            log.write(written[at : at + size])
            at += size
    if len(written) <= head:
        assert files_of(folder) == {LOG: written}
    else:
        assert_whole_account(folder, written, head, tail)


def test_a_log_opened_again_goes_on_where_it_stopped(tmp_path: Path) -> None:
    """A Slurm requeue runs the same attempt's shim again, in the same folder."""
    written = stream(2000)
    with CappedLog(tmp_path, 1000, 4000) as log:
        log.write(written[:30_000])
    with CappedLog(tmp_path, 1000, 4000) as log:
        log.write(written[30_000:])
    assert (tmp_path / LOG).read_bytes().count(MARKER_START) == 1
    assert_whole_account(tmp_path, written, 1000, 4000)


def test_the_log_is_never_written_through_a_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not the log's\n")
    folder = tmp_path / "attempt"
    folder.mkdir()
    (folder / LOG).symlink_to(elsewhere)
    with pytest.raises(OSError):
        CappedLog(folder, 1000, 4000)
    os.mkfifo(folder / "fifo")
    (folder / LOG).unlink()
    (folder / "fifo").rename(folder / LOG)
    with pytest.raises(OSError):  # at once: a FIFO with no reader would block the shim
        CappedLog(folder, 1000, 4000)
    assert elsewhere.read_bytes() == b"not the log's\n"


def test_the_limit_splits_a_quarter_head_and_refuses_a_tiny_one() -> None:
    assert split_limit(64 * 2**20) == (16 * 2**20, 48 * 2**20)
    assert split_limit(200_000) == (50_000, 150_000)
    with pytest.raises(ValueError, match="too small"):
        check_limit(MIN_LOG_LIMIT - 1)


# Reading a long log ---------------------------------------------------------------------------


def test_the_end_of_a_log_is_read_across_its_tail_files(tmp_path: Path) -> None:
    written = stream(960)
    with CappedLog(tmp_path, 1000, 4000) as log:
        log.write(written)
    assert len((tmp_path / LOG_TAIL).read_bytes()) < 1000  # the newest file is short: .1 is read too
    assert read_log_end(tmp_path, 1000).encode() == written[-1000:].partition(b"\n")[2]
    # All of the tail files, never the head's end after a rotation (output is missing between).
    tail = (tmp_path / LOG_TAIL_OLDER).read_bytes() + (tmp_path / LOG_TAIL).read_bytes()
    assert read_log_end(tmp_path, 10**6).encode() == tail.partition(b"\n")[2]


def test_the_end_of_a_log_not_rotated_yet_joins_the_heads_end(tmp_path: Path) -> None:
    written = stream(60)
    with CappedLog(tmp_path, 1000, 4000) as log:
        log.write(written)
    assert not (tmp_path / LOG_TAIL_OLDER).exists()
    text = read_log_end(tmp_path, 800)
    assert text.startswith("line 0000") and text.endswith(stream(1, 59).decode())
    assert "oomguard: output.log reached" in text
    assert read_log_end(tmp_path / "missing", 800) == ""


def printed_by(log: AttemptLog, out: list[str]) -> str:
    log.print_new()
    return "".join(out)


def test_logs_prints_the_head_what_was_dropped_and_the_tail(tmp_path: Path) -> None:
    written = stream(1000)
    with CappedLog(tmp_path, 1000, 4000) as log:
        log.write(written)
    out: list[str] = []
    reader = AttemptLog(tmp_path, out.append)
    shown = printed_by(reader, out)
    reader.close()
    dropped = json.loads((tmp_path / LOG_DROPPED).read_text())["dropped_bytes"]
    tail = (tmp_path / LOG_TAIL_OLDER).read_bytes() + (tmp_path / LOG_TAIL).read_bytes()
    assert shown == (
        (tmp_path / LOG).read_text()
        + f"oomguard logs: {dropped} bytes of output were dropped here (a long log keeps only its first and last bytes)\n"
        + tail.decode()
    )


def test_logs_follow_reads_on_across_renames_and_says_what_it_missed(tmp_path: Path) -> None:
    assert_follows_across_renames(tmp_path)


def assert_follows_across_renames(tmp_path: Path) -> None:
    """`oomguard logs -f` on a log that grows: read after every write, then far behind."""
    written = stream(3000)
    out: list[str] = []
    reader = AttemptLog(tmp_path, out.append)
    with CappedLog(tmp_path, 1000, 4000) as log:
        at = 0
        # Read after every write: each rename is seen through the file held open, nothing is missed.
        while at < 40_000:
            log.write(written[at : at + 700])
            at += 700
            reader.print_new()
        assert "".join(out) == (tmp_path / LOG).read_text() + written[len(split_head((tmp_path / LOG).read_bytes())[0]) : at].decode()
        assert "dropped" not in "".join(out)
        # Far behind: several segments went by between two looks; what no file held any more
        # when it looked is said to be missing, and counted exactly.
        out.clear()
        log.write(written[at : at + 7000])
        reader.print_new()
        held = (tmp_path / LOG_TAIL_OLDER).read_bytes() + (tmp_path / LOG_TAIL).read_bytes()
        shown = "".join(out)
        before = shown[: shown.index("oomguard logs: ")].encode()  # the rest of the file it held open
        assert written[at:].startswith(before)
        missed = 7000 - len(before) - len(held)
        assert missed > 0 and shown == (
            before.decode()
            + f"oomguard logs: {missed} bytes of output were dropped here (a long log keeps only its first and last bytes)\n"
            + held.decode()
        )
        # The writer's count also holds what this reader printed before it was dropped.
        assert json.loads((tmp_path / LOG_DROPPED).read_text())["dropped_bytes"] > missed
    reader.close()


class LowestFreeInodes:
    """os.open, os.stat and os.fstat as on a file system that gives a new file the lowest inode
    number no file has, as ext4 often does: a file made after one was deleted may get its number
    (in a full test run, with other workers making files, ext4 did so now and then). A file made
    in ``folder`` keeps its number while a name there or an open descriptor holds it (the writer
    and the reader are both in this process); other files keep theirs."""

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.folder = folder
        self.reused = 0  # how many files got a number a deleted file had
        self._numbers: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> the number shown
        self._ever: set[int] = set()
        self._real_open, self._real_stat, self._real_fstat = os.open, os.stat, os.fstat
        monkeypatch.setattr(os, "open", self.open)
        monkeypatch.setattr(os, "stat", lambda *args, **kwargs: self._shown(self._real_stat(*args, **kwargs)))
        monkeypatch.setattr(os, "fstat", lambda descriptor: self._shown(self._real_fstat(descriptor)))

    def open(self, path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        made = bool(flags & os.O_CREAT) and self._in_folder(path, dir_fd) and not self._exists(path, dir_fd)
        descriptor = self._real_open(path, flags, mode, dir_fd=dir_fd)
        if made:
            self._number_new(self._real_fstat(descriptor))
        return descriptor

    def _number_new(self, st: os.stat_result) -> None:
        alive = self._alive()
        self._numbers = {key: number for key, number in self._numbers.items() if key in alive}
        taken = set(self._numbers.values())
        number = next(n for n in range(1, len(taken) + 2) if n not in taken)
        self.reused += number in self._ever
        self._ever.add(number)
        self._numbers[(st.st_dev, st.st_ino)] = number

    def _alive(self) -> set[tuple[int, int]]:
        """The files a name in the folder or an open descriptor holds."""
        found = [self._real_stat(path, follow_symlinks=False) for path in self.folder.iterdir()]
        for name in os.listdir("/proc/self/fd"):
            try:
                found.append(self._real_fstat(int(name)))
            except OSError as error:
                if error.errno != errno.EBADF:
                    raise  # EBADF: the listing's own descriptor, closed since
        return {(st.st_dev, st.st_ino) for st in found}

    def _shown(self, st: os.stat_result) -> os.stat_result:
        number = self._numbers.get((st.st_dev, st.st_ino))
        if number is None:
            return st
        fields, named = st.__reduce__()[1]
        return os.stat_result((fields[0], number, *fields[2:]), named)

    def _in_folder(self, path: str, dir_fd: int | None) -> bool:
        if dir_fd is None:
            return Path(path).parent == self.folder
        folder, there = self._real_stat(self.folder), self._real_fstat(dir_fd)
        return (folder.st_dev, folder.st_ino) == (there.st_dev, there.st_ino)

    def _exists(self, path: str, dir_fd: int | None) -> bool:
        try:
            self._real_stat(path, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True


def test_logs_follow_is_not_misled_by_a_new_tail_file_with_a_deleted_ones_inode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new output.tail.log may get the inode number of the output.tail.log.1 that the same
    rotation deleted: the follower must not take it for that file, printed already."""
    file_system = LowestFreeInodes(tmp_path, monkeypatch)
    assert_follows_across_renames(tmp_path)
    assert file_system.reused > 0


@pytest.mark.parametrize(("moment", "name", "missed"), [("after", LOG_TAIL_OLDER, 2000), ("before", LOG_TAIL, 0)])
def test_logs_reads_on_in_order_across_a_rotation_while_it_opens_the_tail_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str, name: str, missed: int
) -> None:
    """`oomguard logs` while the writer rotates once: just after output.tail.log.1 was opened
    (that file is dropped before it is printed: it is said to be missing, as no file holds it),
    or after .1 was printed and before output.tail.log is opened (the segment renamed to .1
    meanwhile is printed before the new output.tail.log). Either way all the output is there,
    printed or said to be missing, in order, and nothing printed is said to be missing."""
    written = stream(3000)
    out: list[str] = []
    with CappedLog(tmp_path, 1000, 4000) as log:
        log.write(written[:10_000])
        assert 0 < log.tail_size < 2000  # so that the 2000 bytes written below rotate once
        kept = len(split_head((tmp_path / LOG).read_bytes())[0])
        dropped = json.loads((tmp_path / LOG_DROPPED).read_text())["dropped_bytes"]
        real_open = AttemptFiles.open
        rotated: list[bool] = []

        def rotate_once(at: str, opening: str) -> None:
            if (at, opening) == (moment, name) and not rotated:
                rotated.append(True)
                log.write(written[10_000:12_000])

        def open_and_rotate(files: AttemptFiles, opening: str) -> BinaryIO:
            rotate_once("before", opening)
            handle = real_open(files, opening)
            rotate_once("after", opening)
            return handle

        monkeypatch.setattr(AttemptFiles, "open", open_and_rotate)
        reader = AttemptLog(tmp_path, out.append)
        reader.print_new()
        reader.close()
    assert "".join(out) == (
        (tmp_path / LOG).read_text()
        + f"oomguard logs: {dropped + missed} bytes of output were dropped here (a long log keeps only its first and last bytes)\n"
        + written[kept + dropped + missed : 12_000].decode()
    )


# The launchers pass the cap on ------------------------------------------------------------------


def test_the_batch_script_gives_the_shim_the_launchers_log_limit(tmp_path: Path) -> None:
    import shlex

    from oomguard.daemon.launch.slurm_text import batch_script
    from tests.unit.test_slurm_options import request

    line = batch_script(request(tmp_path), "/venv/bin/python", log_limit_bytes=200_000).splitlines()[2]
    command = shlex.split(line.removesuffix(" <<'OOMGUARD_ATTEMPT_CONFIG'"))
    assert command[command.index("--log-limit") + 1] == "200000" and command.index("--log-limit") < command.index("--")
    assert "--log-limit" not in batch_script(request(tmp_path), "/venv/bin/python")  # the shim's default


def test_a_launcher_refuses_a_log_limit_too_small_when_it_is_made() -> None:
    from oomguard.daemon.config import SlurmConfig
    from oomguard.daemon.launch.local import LocalLauncher
    from oomguard.daemon.launch.slurm import SlurmLauncher

    assert LocalLauncher(log_limit_bytes=MIN_LOG_LIMIT).log_limit_bytes == MIN_LOG_LIMIT
    assert LocalLauncher().log_limit_bytes is None
    for make in (lambda: LocalLauncher(log_limit_bytes=100), lambda: SlurmLauncher(SlurmConfig(), log_limit_bytes=100)):
        with pytest.raises(ValueError, match="too small"):
            make()
