"""What an attempt ended with. The runner writes it as outcome.json; the doctor reads it."""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass, field
from typing import Any, Literal

from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.plan import Plan

OutcomeKind = Literal["finished", "oom", "host_oom", "diverged", "crashed", "cancelled", "interrupted"]
Phase = Literal["setup", "data", "forward", "backward", "optimizer", "checkpoint"]

# The runner's exit codes. They are documented in the README; the daemon trusts outcome.json
# first and falls back to these when the runner died before writing it.
EXIT_FINISHED = 0
EXIT_CRASHED = 1
EXIT_USAGE = 2
EXIT_OOM = 3
EXIT_DIVERGED = 4
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped on request after a checkpoint; run it again

KIND_BY_EXIT_CODE: dict[int, OutcomeKind] = {
    EXIT_FINISHED: "finished",
    EXIT_OOM: "oom",
    EXIT_DIVERGED: "diverged",
    EXIT_INTERRUPTED: "interrupted",
}


def format_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 2**20:
        return f"{n / 2**10:.1f} KiB"
    if n < 2**30:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryFigures:
    """Device memory at the moment of an OOM, in bytes (None where unknown)."""

    requested: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    free: int | None = None
    total: int | None = None
    # Bytes per consumer (parameters, gradients, optimizer_state, activations) when known.
    breakdown: dict[str, int] = field(default_factory=dict)
    # How many times the CUDA caching allocator freed its cache and retried during the
    # attempt (torch.cuda.memory_stats()["num_alloc_retries"]), when known.
    alloc_retries: int | None = None
    # What the other processes on the same GPU held when this attempt began training and at
    # the OOM (NVML, or the emulated GPU's files), when known: the evidence for contention.
    others_before: int | None = None
    others_at_oom: int | None = None

    @property
    def reserved_unallocated(self) -> int | None:
        if self.reserved is None or self.allocated is None:
            return None
        return self.reserved - self.allocated

    def dominant_consumer(self) -> str | None:
        if not self.breakdown:
            return None
        return max(self.breakdown, key=lambda name: self.breakdown[name])


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    # Optimizer steps completed (and kept in the newest checkpoint or final model) when it ended.
    step: int = 0
    phase: Phase | None = None
    memory: MemoryFigures | None = None
    message: str = ""
    traceback_tail: str = ""
    exit_code: int | None = None
    # Step of the checkpoint the attempt resumed from (None: it started from scratch).
    resumed_from: int | None = None
    # The plan in force when the attempt ended: a probe or an in-process recovery may have
    # changed the one it started with (None: unchanged, or a runner that died first).
    plan: Plan | None = None
    # What the attempt measured, per plan it ran (probe steps included), for the memory model.
    measurements: tuple[Measurement, ...] = ()
    # Rungs taken inside the process, in order: {"step", "from", "to", "rungs", "reason"}.
    recoveries: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["plan"] = self.plan.to_dict() if self.plan is not None else None
        data["measurements"] = [m.to_dict() for m in self.measurements]
        data["recoveries"] = list(self.recoveries)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        # Keys this version does not know (written by a newer runner, or kept in the store
        # across a downgrade) are ignored, as Plan.from_dict does, rather than crash the daemon.
        memory = data.get("memory")
        if memory:
            memory = MemoryFigures(**_known(MemoryFigures, memory))
        plan = data.get("plan")
        return cls(
            **{
                **_known(cls, data),
                "memory": memory or None,
                "plan": Plan.from_dict(plan) if plan else None,
                "measurements": tuple(Measurement.from_dict(m) for m in data.get("measurements") or ()),
                "recoveries": tuple(data.get("recoveries") or ()),
            }
        )

    @classmethod
    def from_exit_status(cls, returncode: int) -> Outcome:
        """For a runner that ended without writing outcome.json (killed, or died hard)."""
        if returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = str(-returncode)
            return cls(kind="crashed", message=f"the runner was killed by {name} before it could report", exit_code=returncode)
        kind = KIND_BY_EXIT_CODE.get(returncode, "crashed")
        return cls(kind=kind, message=f"the runner exited with code {returncode} without writing outcome.json", exit_code=returncode)


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}
