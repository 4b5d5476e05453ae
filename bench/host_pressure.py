"""Host memory pressure on demand, for the faults benchmark and its test (Linux, root).

A memory cgroup (v1 or v2) holds the daemon and everything it starts. To squeeze, its limit
is lowered to what it uses now that cannot be reclaimed (its usage without file cache) plus a
margin, and a hog process in the same cgroup allocates past it: the kernel's OOM killer then
ends the process it scores highest, as it would on a box whose RAM ran out because someone
else's process grew. The limit is lifted and the hog ended after a short hold, as when that
process goes away.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MiB = 1 << 20

# The hog: allocates CHUNK bytes at a time, touching every page (a plain bytearray(n) may get
# untouched zero pages), up to the size given, says so, then waits to be ended.
_HOG = """
import sys, time
size, chunk, held = int(sys.argv[1]), int(sys.argv[2]), []
while sum(map(len, held)) < size:
    held.append(b"\\1" * chunk)
    time.sleep(0.01)
print("holding", flush=True)
time.sleep(3600)
"""


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    version: int  # 1 or 2

    @classmethod
    def create(cls, name: str) -> MemoryCgroup:
        """A new memory cgroup; OSError (with the reason) where this machine cannot make one."""
        v1, v2_controllers = CGROUP_ROOT / "memory", CGROUP_ROOT / "cgroup.subtree_control"
        if (v1 / "memory.limit_in_bytes").exists():
            cgroup = cls(v1 / name, 1)
        elif v2_controllers.exists() and "memory" in v2_controllers.read_text().split():
            cgroup = cls(CGROUP_ROOT / name, 2)
        else:
            raise OSError(f"no memory cgroup controller under {CGROUP_ROOT} (v1 memory/ or v2 with memory in cgroup.subtree_control)")
        cgroup.path.mkdir()
        return cgroup

    def _file(self, v1: str, v2: str) -> Path:
        return self.path / (v1 if self.version == 1 else v2)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def usage(self) -> int:
        return int(self._file("memory.usage_in_bytes", "memory.current").read_text())

    def file_cache(self) -> int:
        """Bytes of file pages (page cache) charged to the cgroup: the kernel reclaims those
        before it kills anything."""
        stat = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
        prefix = "total_" if self.version == 1 else ""
        return int(stat.get(f"{prefix}active_file", 0)) + int(stat.get(f"{prefix}inactive_file", 0))

    def set_limit(self, limit: int | None) -> None:
        """``None``: no limit."""
        value = str(limit) if limit is not None else ("-1" if self.version == 1 else "max")
        self._file("memory.limit_in_bytes", "memory.max").write_text(value)

    def oom_kills(self) -> int:
        """The kernel's OOM kills in this cgroup so far."""
        text = self._file("memory.oom_control", "memory.events").read_text()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        raise OSError(f"{self.path}: the kernel reports no oom_kill count (Linux 4.13 or later needed)")

    def pids(self) -> list[int]:
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]

    def remove(self, timeout: float = 10.0) -> None:
        """Remove the cgroup once its processes are gone (they are not killed here)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def unavailable(name: str = f"oomguard-probe-{os.getpid()}") -> str | None:
    """Why no memory cgroup can be made here (None: one can)."""
    if os.geteuid() != 0:
        return "needs root to make a memory cgroup"
    try:
        MemoryCgroup.create(name).remove()
    except OSError as error:
        return f"no memory cgroup: {error}"
    return None


@dataclass(frozen=True)
class Squeeze:
    """One episode of pressure: what the cgroup used when it began and the OOM kills it caused."""

    usage_before: int
    limit: int
    kills: int


def squeeze(cgroup: MemoryCgroup, margin: int = 48 * MiB, hold: float = 1.0, grace: float = 2.0) -> Squeeze:
    """Lower the cgroup's limit to its usage without file cache plus ``margin`` and start a hog
    that allocates twice the margin in it; wait for the kernel's OOM kill (at most ``grace``
    seconds after the hog holds all it asked for), hold the pressure for ``hold`` seconds,
    then lift the limit and end the hog."""
    kills_before = cgroup.oom_kills()
    usage = cgroup.usage()
    limit = usage - cgroup.file_cache() + margin
    try:
        cgroup.set_limit(limit)  # the kernel reclaims the cache down to it first
    except OSError:  # EBUSY: it could not reclaim that much right now
        limit = usage + margin
        cgroup.set_limit(limit)
    hog = subprocess.Popen(
        [sys.executable, "-c", _HOG, str(2 * margin), str(4 * MiB)],
        stdout=subprocess.PIPE,
        # In the cgroup before it allocates anything.
        preexec_fn=lambda: cgroup.add(os.getpid()),
    )
    assert hog.stdout is not None
    try:
        holding_since: float | None = None
        while cgroup.oom_kills() == kills_before and hog.poll() is None:
            if holding_since is None and select.select([hog.stdout], [], [], 0.02)[0]:
                holding_since = time.monotonic()  # it holds all it asked for and nothing was killed (yet)
            elif holding_since is not None and time.monotonic() - holding_since > grace:
                break
            else:
                time.sleep(0.02)
        time.sleep(hold)
    finally:
        cgroup.set_limit(None)
        hog.kill()
        hog.wait()
    return Squeeze(usage_before=usage, limit=limit, kills=cgroup.oom_kills() - kills_before)
