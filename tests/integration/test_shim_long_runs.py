"""The shim over runs of weeks: the command's log is capped (its head and its end kept, and
read back whole by `oomguard logs` and by the daemon's conclusion), and the shim sleeps while
its command runs quietly instead of looking around five times a second."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from oomguard.daemon import processes
from oomguard.daemon.conclude import outcome_without_report
from oomguard.daemon.shim import EXIT_STATUS
from oomguard.jobs.attempt import LOG, LOG_DROPPED, LOG_TAIL, LOG_TAIL_OLDER
from tests.e2e.conftest import oomguard, tiny_job
from tests.integration.test_shim import COMMAND_JOB_ENV, SCRIPTS, start_shim, wait_for_text

OOM = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 88, in <module>\n'
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 30.29 GiB. GPU 0 has a total capacity of 10.74 GiB of which "
    "3.69 GiB is free. Including non-PyTorch memory, this process has 6.68 GiB memory in use. Of the allocated memory 6.10 GiB "
    "is allocated by PyTorch, and 396.58 MiB is reserved by PyTorch but unallocated.\n"
)
# 5 MB of numbered lines, some with a two-byte character, then the OOM; written as a program
# buffers its output (8 KiB at a time), through the shim's pipe.
TALKER = (
    "import sys\n"
    "out = sys.stdout.buffer\n"
    "for n in range(84_000):\n"
    "    out.write(('step %07d loss 0.5 \\u00e9 ' % n).encode() + b'x' * 34 + b'\\n')\n"
    f"out.write({OOM!r}.encode())\n"
    "sys.exit(1)\n"
)
LIMIT = 200_000  # head 50,000 bytes, tail 150,000 (two files of 75,000)


def talker_output() -> bytes:
    return b"".join(("step %07d loss 0.5 \u00e9 " % n).encode() + b"x" * 34 + b"\n" for n in range(84_000)) + OOM.encode()


def test_a_long_log_keeps_its_head_and_end_within_the_limit_and_its_oom_is_found(tmp_path: Path) -> None:
    attempt = tmp_path / "wd" / "attempts" / "001"
    shim = subprocess.Popen(
        [sys.executable, "-m", "oomguard.daemon.shim", str(attempt), "--log-limit", str(LIMIT), "--", sys.executable, "-c", TALKER],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    _, errors = shim.communicate(timeout=120)
    assert shim.returncode == 0, errors
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == 1

    written = talker_output()
    assert len(written) > 5_000_000
    files = {path.name: path.read_bytes() for path in attempt.iterdir() if path.name.startswith("output.")}
    assert set(files) == {LOG, LOG_TAIL, LOG_TAIL_OLDER, LOG_DROPPED}
    assert sum(map(len, files.values())) <= LIMIT + 400  # the marker line and the count
    # The head: the first whole lines, then where the rest went.
    head, _, marker = files[LOG].rpartition(b"oomguard: output.log reached ")
    assert written.startswith(head) and head.endswith(b"\n") and 49_000 < len(head) <= 50_000
    assert marker.startswith(f"{len(head)} bytes; the rest of the output goes to output.tail.log".encode())
    # The end: every byte after what was dropped, the OOM last.
    dropped = json.loads(files[LOG_DROPPED])["dropped_bytes"]
    tail = files[LOG_TAIL_OLDER] + files[LOG_TAIL]
    assert written[len(head) + dropped :] == tail and tail.endswith(OOM.encode()) and len(tail) >= 75_000

    # The daemon's conclusion reads the end: an OOM, not a crash.
    outcome = outcome_without_report(attempt, status["returncode"], status["failed_process"], status["oom_kills"])
    assert outcome.kind == "oom" and "CUDA out of memory. Tried to allocate 30.29 GiB" in outcome.message, outcome

    # `oomguard logs` prints the head, how much was dropped, and the tail.
    state = _state_with_attempt(tmp_path, attempt)
    shown = oomguard("logs", "1", state_dir=state, check=True).stdout
    assert shown == (
        "== attempt 1 (mb=8x1) ==\n" + files[LOG].decode()
        + f"oomguard logs: {dropped} bytes of output were dropped here (a long log keeps only its first and last bytes)\n"
        + tail.decode(errors="replace")
    )
    # So does `oomguard diagnose` of the attempt's folder, or of its output.log.
    for given in (attempt, attempt / LOG):
        verdict = json.loads(oomguard("diagnose", str(given), "--json", check=True).stdout)
        assert verdict["kind"] == "oom" and "Tried to allocate 30.29 GiB" in verdict["message"], verdict


def _state_with_attempt(tmp_path: Path, attempt: Path) -> Path:
    from oomguard.daemon.paths import StateDir
    from oomguard.daemon.store import Store
    from oomguard.daemon.supervisor import Supervisor
    from oomguard.daemon.users import Account
    from oomguard.jobs.spec import load_job_file

    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    job_id = Supervisor(state, store).add_job(load_job_file(tiny_job(tmp_path)), Account.current())
    store.add_attempt(job_id=job_id, number=1, plan=store.job(job_id).plan_json, directory=str(attempt), started_at=1.0)
    store.close()
    return state.root


def voluntary_switches(pid: int) -> dict[int, int]:
    """Each thread's count of the times it went to sleep (and so woke again)."""
    counts = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # a thread that just ended
        counts[int(task.name)] = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt_switches:"))
    return counts


def test_the_shim_sleeps_while_its_command_is_quiet(tmp_path: Path) -> None:
    attempt = tmp_path / "quiet"
    shim = start_shim(attempt, sys.executable, "-c", "import time\nprint('ready', flush=True)\ntime.sleep(600)")
    try:
        wait_for_text(attempt / LOG, "ready")
        time.sleep(0.5)  # the shim has copied the line and sleeps again
        before = voluntary_switches(shim.pid)
        time.sleep(2.0)
        after = voluntary_switches(shim.pid)
    finally:
        os.killpg(shim.pid, signal.SIGTERM)
        assert shim.wait(timeout=30) == 0
    woke = sum(count - before.get(thread, 0) for thread, count in after.items())
    # Looking for marks every 0.2 s woke it about ten times in 2 s; it now waits for events only.
    assert woke <= 2, (before, after)
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == -signal.SIGTERM and status["signals"] == ["SIGTERM"]


# Where there is no pidfd and no inotify watch: the shim looks every 0.2 s, as it always did.
WITHOUT_EVENTS = (
    "import os, runpy, watchdog.observers\n"
    "del os.pidfd_open\n"
    "def refuse(self):\n"
    "    raise OSError(24, 'inotify instances used up')\n"
    "watchdog.observers.Observer.start = refuse\n"
    "runpy.run_module('oomguard.daemon.shim', run_name='__main__', alter_sys=True)\n"
)


def test_without_pidfd_or_inotify_a_failed_rank_still_brings_the_attempt_down(tmp_path: Path) -> None:
    attempt = tmp_path / "ranks"
    shim = subprocess.Popen(
        [sys.executable, "-c", WITHOUT_EVENTS, str(attempt), "--",
         sys.executable, str(SCRIPTS / "naive_launcher.py"), "2", sys.executable, str(SCRIPTS / "hanging_rank.py")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=COMMAND_JOB_ENV,
    )
    _, errors = shim.communicate(timeout=60)
    assert shim.returncode == 0, errors
    status = json.loads((attempt / EXIT_STATUS).read_text())
    failed = status["failed_process"]
    assert failed["rank"] == "0" and failed["out_of_memory"] is True
    assert status["torn_down_at"] - failed["at"] < 1.0 and status["returncode"] != 0
    assert processes.marked_with(str(attempt)) == set()
    assert "stopping every process of the attempt" in (attempt / LOG).read_text()


def test_the_local_launcher_gives_its_shims_its_log_limit(tmp_path: Path) -> None:
    from oomguard.daemon.launch import LaunchRequest
    from oomguard.daemon.launch.local import LocalLauncher
    from oomguard.daemon.log_cap import MIN_LOG_LIMIT, split_limit
    from oomguard.daemon.users import Account
    from oomguard.jobs.attempt import AttemptFiles

    workdir = tmp_path / "wd"
    workdir.mkdir()
    attempt = workdir / "attempts" / "001"
    launcher = LocalLauncher(log_limit_bytes=MIN_LOG_LIMIT)
    printer = "import sys\nfor n in range(20_000):\n    print('line', n)\n"
    handle = launcher.start(LaunchRequest(
        attempt_dir=attempt, argv=(sys.executable, "-c", printer), env=dict(os.environ), owner=Account.current(), workdir=workdir,
        cwd=None, stdin=b"{}", gpus=None,
    ))
    deadline = time.monotonic() + 60
    while launcher.running(handle):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert launcher.collect(handle, os.getuid(), AttemptFiles(attempt)).returncode == 0
    head, _ = split_limit(MIN_LOG_LIMIT)
    assert (attempt / LOG).stat().st_size <= head + 400 and (attempt / LOG_TAIL).read_text().endswith("line 19999\n")
