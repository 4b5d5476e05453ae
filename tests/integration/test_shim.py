"""The attempt shim: it writes the attempt's configuration, runs the command in the
attempt's log, and records the exit status for whichever daemon looks next."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oomguard.daemon import kernel_oom, processes
from oomguard.daemon.shim import EXIT_STATUS
from oomguard.daemon.supervisor import outcome_without_report
from oomguard.jobs.command import BOOTSTRAP_DIR
from tests.conftest import as_root


SCRIPTS = Path(__file__).parents[1] / "scripts"
# As the daemon starts a command job: its Python processes load the bootstrap.
COMMAND_JOB_ENV = {**os.environ, "PYTHONPATH": str(BOOTSTRAP_DIR)}


def start_shim(attempt_dir: Path, *command: str, config: str = '{"number": 1}', env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "oomguard.daemon.shim", str(attempt_dir), "--", *command],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env,
    )
    assert process.stdin is not None
    process.stdin.write(config.encode())
    process.stdin.close()
    return process


def test_the_shim_writes_the_config_runs_the_command_and_records_its_exit(tmp_path: Path):
    attempt = tmp_path / "attempts" / "001"
    shim = start_shim(attempt, sys.executable, "-c", "import sys; print('hello from the runner'); sys.exit(3)")
    assert shim.wait(timeout=30) == 0
    assert json.loads((attempt / "attempt.json").read_text()) == {"number": 1}
    assert "hello from the runner" in (attempt / "output.log").read_text()
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == 3 and status["signals"] == []


def test_sigterm_to_the_group_reaches_the_command_and_the_shim_records_it(tmp_path: Path):
    attempt = tmp_path / "a"
    script = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\nprint('ready', flush=True)\ntime.sleep(60)"
    shim = start_shim(attempt, sys.executable, "-c", script)
    deadline = time.monotonic() + 30
    while "ready" not in ((attempt / "output.log").read_text() if (attempt / "output.log").exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(shim.pid, signal.SIGTERM)
    assert shim.wait(timeout=30) == 0
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == 75 and status["signals"] == ["SIGTERM"]


def test_a_command_that_cannot_start_is_recorded(tmp_path: Path):
    shim = start_shim(tmp_path / "b", str(tmp_path / "no-such-program"))
    assert shim.wait(timeout=30) == 127
    status = json.loads((tmp_path / "b" / EXIT_STATUS).read_text())
    assert status["returncode"] == 127 and "No such file" in status["error"]
    assert "cannot start" in (tmp_path / "b" / "output.log").read_text()


def test_a_command_runs_in_its_cwd_and_a_missing_one_is_named(tmp_path: Path):
    (tmp_path / "project").mkdir()
    for attempt, cwd in ((tmp_path / "here", tmp_path / "project"), (tmp_path / "gone", tmp_path / "project-moved")):
        shim = subprocess.Popen(
            [sys.executable, "-m", "oomguard.daemon.shim", str(attempt), "--cwd", str(cwd), "--", sys.executable, "-c", "import os; print(os.getcwd())"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        shim.wait(timeout=30)
    assert (tmp_path / "here" / "output.log").read_text() == f"{tmp_path / 'project'}\n"
    missing = tmp_path / "project-moved"
    assert (tmp_path / "gone" / "output.log").read_text().splitlines() == [
        f"oomguard: cannot start {sys.executable} in its [command] cwd {missing}: No such file or directory",
        f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'",
    ]
    assert outcome_without_report(tmp_path / "gone", 127).summary == f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'"


def test_bad_usage(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "oomguard.daemon.shim", str(tmp_path)], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "usage:" in done.stderr


def test_a_process_is_known_by_pid_and_start_time():
    me = processes.start_ticks(os.getpid())
    assert me is not None and processes.is_running(os.getpid(), me)
    assert not processes.is_running(os.getpid(), me + 1)  # the same pid, another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while processes.start_ticks(child.pid) is not None:  # a zombie until collected: not running
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.wait()
    assert processes.start_ticks(child.pid) is None


def test_attempt_files_are_read_only_as_regular_files_never_through_a_link(tmp_path: Path):
    """The daemon runs as root and reads files in users' folders: a link or a FIFO there is
    treated as nothing reported, never followed or waited on."""
    from oomguard.jobs.attempt import read_json

    secret = tmp_path / "secret.json"
    secret.write_text('{"root": "only"}')
    (tmp_path / "heartbeat.json").symlink_to(secret)
    os.mkfifo(tmp_path / "outcome.json")
    (tmp_path / "exit.json").write_text('{"returncode": 0')  # half written
    (tmp_path / "good.json").write_text('{"returncode": 0}')
    assert read_json(tmp_path / "heartbeat.json") is None
    assert read_json(tmp_path / "outcome.json") is None  # returns at once, no writer needed
    assert read_json(tmp_path / "exit.json") is None
    assert read_json(tmp_path / "missing.json") is None
    assert read_json(tmp_path / "good.json") == {"returncode": 0}


def wait_for_text(path: Path, text: str, timeout: float = 90) -> None:
    """Waits for ``text`` in ``path``; on a busy 2-core machine three Python processes may take
    a while to start, so the failure shows what the file held and what was running."""
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        if time.monotonic() > deadline:
            running = subprocess.run(["ps", "-eo", "pid,ppid,etime,pcpu,stat,args"], capture_output=True, text=True).stdout
            held = path.read_text() if path.exists() else "(no file)"
            raise AssertionError(f"{text!r} never appeared in {path} within {timeout} s; it held:\n{held}\nrunning:\n{running[-6000:]}")
        time.sleep(0.05)


def test_a_rank_that_runs_out_of_memory_brings_every_process_of_the_attempt_down(tmp_path: Path):
    # The launcher waits for every rank; rank 0 hangs while exiting after its OOM; rank 1
    # waits forever and ignores SIGTERM. Left alone, nothing would end for 10 minutes.
    attempt = tmp_path / "ranks"
    shim = start_shim(attempt, sys.executable, str(SCRIPTS / "naive_launcher.py"), "2", sys.executable, str(SCRIPTS / "hanging_rank.py"), env=COMMAND_JOB_ENV)
    assert shim.wait(timeout=60) == 0
    status = json.loads((attempt / EXIT_STATUS).read_text())
    failed = status["failed_process"]
    assert failed["rank"] == "0" and failed["world_size"] == 2 and failed["out_of_memory"] is True
    assert failed["error"].startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB")
    assert status["torn_down_at"] - failed["at"] < 1.0  # seen at the next look (every 0.2 s)
    assert status["ended_at"] - failed["at"] < 10.0  # SIGKILL after 3 s for what ignores SIGTERM
    assert status["returncode"] != 0
    assert processes.marked_with(str(attempt)) == set()
    log = (attempt / "output.log").read_text()
    said = next(line for line in log.splitlines() if line.startswith("oomguard: rank 0 (pid "))
    # The process by its program and script; the error whole (not cut mid-word at 300 characters).
    assert re.match(r"oomguard: rank 0 \(pid \d+, python[\d.]* \S*hanging_rank\.py\) died of OutOfMemoryError: CUDA out of memory", said), said
    assert said.endswith("; stopping every process of the attempt") and "…" not in said
    assert "Traceback" in log and "OutOfMemoryError: CUDA out of memory" in log  # Python still printed it


def test_an_error_the_script_catches_brings_nothing_down(tmp_path: Path):
    attempt = tmp_path / "caught"
    script = (
        "class OutOfMemoryError(RuntimeError): pass\n"
        "try:\n    raise OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 MiB')\n"
        "except OutOfMemoryError:\n    print('retrying smaller', flush=True)\n"
    )
    shim = start_shim(attempt, sys.executable, "-c", script, env=COMMAND_JOB_ENV)
    assert shim.wait(timeout=30) == 0
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == 0 and status["failed_process"] is None and status["torn_down_at"] is None


def test_an_uncaught_error_in_a_single_process_is_recorded_only_when_it_is_an_oom(tmp_path: Path):
    shim = start_shim(tmp_path / "plain", sys.executable, "-c", "raise ValueError('a bug')", env=COMMAND_JOB_ENV)
    assert shim.wait(timeout=30) == 0
    assert json.loads((tmp_path / "plain" / EXIT_STATUS).read_text())["failed_process"] is None
    shim = start_shim(tmp_path / "oom", sys.executable, "-c", "raise RuntimeError('CUDA error: out of memory')", env=COMMAND_JOB_ENV)
    assert shim.wait(timeout=30) == 0
    failed = json.loads((tmp_path / "oom" / EXIT_STATUS).read_text())["failed_process"]
    assert failed["rank"] is None and failed["error"] == "RuntimeError: CUDA error: out of memory"


def test_processes_the_command_leaves_behind_are_ended_with_the_attempt(tmp_path: Path):
    attempt = tmp_path / "orphans"
    script = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "print('left', child.pid, flush=True)\n"
    )
    shim = start_shim(attempt, sys.executable, "-c", script)
    assert shim.wait(timeout=30) == 0
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == 0 and status["left_over"] == 1
    left = int((attempt / "output.log").read_text().split("left ")[1].split()[0])
    assert processes.start_ticks(left) is None
    assert "ended 1 process(es) of the attempt left running" in (attempt / "output.log").read_text()


def test_sigterm_to_the_shims_group_reaches_ranks_in_sessions_of_their_own(tmp_path: Path):
    attempt = tmp_path / "cancelled"
    # One write(2) per rank: print() with several arguments writes each piece on its own when
    # output is unbuffered, and two ranks' pieces then interleave ("rankrank 1  0up").
    rank = "import os, time\nos.write(1, f\"rank {os.environ['RANK']} up\\n\".encode())\ntime.sleep(600)"
    # The launcher outlives SIGTERM and waits for its ranks, so the attempt ends only if the
    # shim passes the signal on to them; they are gone before the launcher's exit is seen
    # (nothing is left for the shim's teardown: left_over 0, whatever the load).
    launcher = (str(SCRIPTS / "naive_launcher.py"), "--ignore-sigterm", "2")
    shim = start_shim(attempt, sys.executable, *launcher, sys.executable, "-c", rank)
    for number in (0, 1):
        wait_for_text(attempt / "output.log", f"rank {number} up")
    started = time.monotonic()
    os.killpg(shim.pid, signal.SIGTERM)  # what the daemon does to cancel
    assert shim.wait(timeout=30) == 0
    assert time.monotonic() - started < 5
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["signals"] == ["SIGTERM"] and status["left_over"] == 0
    assert processes.marked_with(str(attempt)) == set()


def test_the_training_command_is_the_kernels_first_choice_under_host_memory_pressure(tmp_path: Path):
    attempt = tmp_path / "score"
    shim = start_shim(attempt, sys.executable, "-c", "print('score', open('/proc/self/oom_score_adj').read().strip())")
    assert shim.wait(timeout=30) == 0
    assert f"score {kernel_oom.TRAINING_OOM_SCORE_ADJ}" in (attempt / "output.log").read_text()
    assert Path(f"/proc/{os.getpid()}/oom_score_adj").read_text().strip() != str(kernel_oom.TRAINING_OOM_SCORE_ADJ)
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert isinstance(status["oom_kills"], int)  # the kernel's count was read before and after


def test_the_kernel_oom_count_is_read_from_vmstat(tmp_path: Path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 1000\noom_kill 7\nnr_foo 3\n")
    assert kernel_oom.kills(vmstat) == 7
    vmstat.write_text("nr_free_pages 1000\n")  # a kernel older than 4.13
    assert kernel_oom.kills(vmstat) is None
    assert kernel_oom.kills(tmp_path / "missing") is None
    assert kernel_oom.kills_between(7, 9) == 2 and kernel_oom.kills_between(None, 9) is None


def _memory_cgroup_or_skip(name: str):
    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    import host_pressure

    why = host_pressure.unavailable()
    if why:
        pytest.skip(why)
    return host_pressure.MemoryCgroup.create(name)


def test_a_command_the_kernels_oom_killer_ends_is_recorded_as_host_oom(tmp_path: Path):
    # A real OOM kill: the shim and its command in a memory cgroup of 160 MiB, the command
    # allocating 400 MiB. The kernel ends the command (its raised score), not the shim.
    cgroup = _memory_cgroup_or_skip(f"oomguard-test-{os.getpid()}")
    try:
        cgroup.set_limit(160 << 20)
        attempt = tmp_path / "host"
        grow = "import time\nheld = []\nfor _ in range(100):\n    held.append(b'1' * (4 << 20)); time.sleep(0.005)\nprint('not killed')"
        shim = subprocess.Popen(
            [sys.executable, "-m", "oomguard.daemon.shim", str(attempt), "--", sys.executable, "-c", grow],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, preexec_fn=lambda: cgroup.add(os.getpid()),
        )
        assert shim.wait(timeout=60) == 0
    finally:
        cgroup.remove()
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == -signal.SIGKILL and status["oom_kills"] >= 1, status
    assert "not killed" not in (attempt / "output.log").read_text()
    outcome = outcome_without_report(attempt, status["returncode"], status["failed_process"], status["oom_kills"])
    assert outcome.kind == "host_oom" and "the kernel's OOM killer ended a process of the attempt" in outcome.message


def test_a_long_error_is_cut_between_words_in_the_shims_line():
    from oomguard.daemon.shim import ERROR_CHARS, _clipped

    words = "OutOfMemoryError: CUDA out of memory. " + " ".join(f"reserved{n} by PyTorch but unallocated" for n in range(60))
    clipped = _clipped(words)
    assert len(clipped) <= ERROR_CHARS and clipped.endswith(" …")
    assert words.startswith(clipped[: -len(" …")]) and words[len(clipped) - len(" …")] == " "  # ends where a word ends
    assert _clipped("RuntimeError: short") == "RuntimeError: short"


@as_root
def test_a_mark_put_on_a_process_by_another_user_does_not_make_it_the_attempts(accounts, tmp_path: Path):
    """The mark is an environment variable: bob can put alice's attempt folder in his own
    process's environment. As root, only the attempt owner's processes count as the attempt's
    (its GPU memory, and what is ended with it)."""
    alice, bob = accounts["alice"], accounts["bob"]
    attempt = str(tmp_path / "alices-attempt")
    env = {"PATH": os.environ["PATH"], processes.ATTEMPT_DIR_ENV: attempt}
    sleepers = [
        subprocess.Popen(["sleep", "60"], env=env, user=account.uid, group=account.gid, extra_groups=[])
        for account in (alice, bob)
    ]
    try:
        deadline = time.monotonic() + 30
        while len(processes.marked_with(attempt)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert processes.marked_with(attempt, alice.uid) == {sleepers[0].pid}
        assert processes.marked_with(attempt, bob.uid) == {sleepers[1].pid}
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
