"""The runner, started from a warm process: tests fork each runner from a server that has
already imported torch and diffusers, instead of paying those imports (about 4 s of CPU on 2
cores) in every one of the twenty-odd runners they start.

Each runner is still a process of its own: its own memory, signal handlers and emulated
device, its exit code, its files. What differs from `python -m oomguard.jobs.run` is only that
the imports happened before the fork; the daemon's tests (tests/e2e) start the real command.

The server imports tests/warm_runner_server.py before it forks the first runner.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


def _run(attempt_dir: str, stdout_path: str, stderr_path: str, environment: dict[str, str]) -> None:
    """The child: jobs/run.py's main() under the test's environment (the server has the one it
    was started with), its output in two files, then exit with its code."""
    from oomguard.jobs import run

    os.environ.clear()
    os.environ.update(environment)

    for fd, path in ((1, stdout_path), (2, stderr_path)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    code = run.main([attempt_dir])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["tests.warm_runner_server"])


@dataclass
class Runner:
    """A runner forked from the warm server; its stdout and stderr go to two temporary files."""

    process: multiprocessing.process.BaseProcess
    stdout_path: Path
    stderr_path: Path

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """Its exit code and output once it has ended; killed after ``timeout`` seconds (then
        TimeoutError)."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.kill()
            raise TimeoutError(f"the runner did not end within {timeout:.0f} s:\n{self._read(self.stderr_path)[-3000:]}")
        return self.process.exitcode, self._read(self.stdout_path), self._read(self.stderr_path)

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        finally:
            path.unlink(missing_ok=True)


def start(attempt_dir: Path, environment: dict[str, str]) -> Runner:
    """``python -m oomguard.jobs.run ATTEMPT_DIR`` under ``environment``, forked from the warm
    server. What torch reads as it loads (OMP_NUM_THREADS) is the server's:
    tests/warm_runner_server.py sets it."""
    paths = []
    for stream in ("stdout", "stderr"):
        handle, name = tempfile.mkstemp(prefix=f"oomguard-runner-{stream}-")
        os.close(handle)
        paths.append(Path(name))
    process = _CONTEXT.Process(target=_run, args=(str(attempt_dir), *map(str, paths), environment))
    process.start()
    return Runner(process, *paths)
