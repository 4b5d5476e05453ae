"""The runner of a plan with several processes (``Plan.world_size`` > 1): it starts one rank
per GPU, passes signals on, tears the ranks down together, and turns their ends into the
attempt's one outcome.json. It imports no torch (it only watches).

Each rank is ``python -m oomguard.jobs.run ATTEMPT_DIR`` with torch.distributed's variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and writes its Outcome to
``ranks/RANK.json``. The ranks agree on every decision (jobs/rank_group.py), so in a normal
end all of them end together and rank 0's outcome is the attempt's. A rank that ends on its
own (its OOM inside a collective of a sharded model, a crash, the kernel's OOM killer) leaves
the others in a collective that fails (gloo sees the connection close) or never completes:
they are killed ``TEARDOWN_SECONDS`` later, and the outcome of the rank that ended the attempt
is the attempt's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.jobs.attempt import OUTCOME, write_json_atomic
from oomguard.strategies.outcome import EXIT_CRASHED, KIND_BY_EXIT_CODE

RANKS_DIR = "ranks"
# The environment variable a rank reads its rank from (torch.distributed's own).
RANK_ENV = "RANK"
# How long the other ranks may take to end after one rank ended first, before they are killed:
# in a normal end they end within a barrier of each other.
TEARDOWN_SECONDS = 5.0
POLL_SECONDS = 0.05


@dataclass(frozen=True)
class RankEnd:
    rank: int
    returncode: int
    at: float
    # Killed here because another rank had ended (not its own end).
    torn_down: bool


def rank_outcome_path(attempt_dir: Path, rank: int) -> Path:
    return attempt_dir / RANKS_DIR / f"{rank}.json"


def free_port() -> int:
    """A TCP port free on this host now, for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environment(env: dict[str, str], rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        **env, RANK_ENV: str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }


def run_ranks(attempt_dir: Path, world_size: int) -> int:
    """Start the ranks, wait for them all and write outcome.json; the attempt's exit code."""
    (attempt_dir / RANKS_DIR).mkdir(exist_ok=True)
    for stale in (attempt_dir / RANKS_DIR).glob("*.json"):
        stale.unlink()
    port = free_port()
    command = [sys.executable, "-m", "oomguard.jobs.run", str(attempt_dir)]
    processes = [subprocess.Popen(command, env=rank_environment(dict(os.environ), rank, world_size, port)) for rank in range(world_size)]

    def pass_on(signum: int, frame: object) -> None:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(signum, pass_on)
    ends = _wait(processes)
    outcome = attempt_outcome(attempt_dir, ends)
    write_json_atomic(attempt_dir / OUTCOME, outcome)
    return int(outcome["exit_code"])


def _wait(processes: list[subprocess.Popen[bytes]]) -> list[RankEnd]:
    """Every rank's end, in the order they ended; the rest killed TEARDOWN_SECONDS after the
    first one ended (the ranks still running then wait on one that is gone)."""
    ends: dict[int, RankEnd] = {}
    killed: set[int] = set()
    first_end: float | None = None
    while len(ends) < len(processes):
        now = time.monotonic()
        for rank, process in enumerate(processes):
            if rank not in ends and (code := process.poll()) is not None:
                ends[rank] = RankEnd(rank, code, now, torn_down=rank in killed)
                first_end = first_end if first_end is not None else now
        if first_end is not None and now - first_end >= TEARDOWN_SECONDS:
            for rank, process in enumerate(processes):
                if rank not in ends and rank not in killed:
                    process.kill()
                    killed.add(rank)
        time.sleep(POLL_SECONDS)
    return sorted(ends.values(), key=lambda end: end.at)


def attempt_outcome(attempt_dir: Path, ends: list[RankEnd]) -> dict[str, Any]:
    """The attempt's outcome (with its exit_code) from the ranks' ends: rank 0's when every rank
    ended the same way by itself (the ranks agreed); else the outcome that ended the attempt:
    the first rank's to end, a rank's own end (an OOM, a full disk) before a crash, which is
    what a collective does when its peer has gone."""
    outcomes = {end.rank: _read(rank_outcome_path(attempt_dir, end.rank)) for end in ends}
    kinds = {(outcome or {}).get("kind") for outcome in outcomes.values()}
    agreed = len(kinds) == 1 and None not in kinds and not any(end.torn_down for end in ends)
    if agreed:
        deciding = next(end for end in ends if end.rank == 0)
    else:
        deciding = min(ends, key=lambda end: ((outcomes[end.rank] or {}).get("kind", "crashed") == "crashed", end.at))
    outcome = outcomes[deciding.rank]
    if outcome is None:
        how = f"was killed by signal {-deciding.returncode}" if deciding.returncode < 0 else f"exited with code {deciding.returncode}"
        outcome = {
            "kind": "crashed", "message": f"rank {deciding.rank} of {len(ends)} {how} without an outcome", "exit_code": EXIT_CRASHED,
        }
    if not agreed:
        others = "; ".join(
            f"rank {end.rank} stopped {TEARDOWN_SECONDS:.0f} s after the first end" if end.torn_down
            else f"rank {end.rank} then ended: {(outcomes[end.rank] or {}).get('kind', 'no outcome')}"
            for end in ends if end is not deciding
        )
        outcome["message"] = f"{outcome.get('message') or outcome['kind']} (rank {deciding.rank} ended it; {others})"
    outcome.setdefault("exit_code", next((code for code, kind in KIND_BY_EXIT_CODE.items() if kind == outcome["kind"]), EXIT_CRASHED))
    return outcome


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
