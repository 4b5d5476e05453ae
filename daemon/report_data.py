"""What `oomguard report JOB` draws, as plain frozen values: each attempt's steps (memory, cap,
samples/s), the OOMs and rungs to mark, and the samples/s each plan reached. report.py loads
them from the store and the attempt directories; report_plot.py draws them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OomKind = Literal["ended", "in-process", "probe"]
RungSource = Literal["daemon", "runner"]


@dataclass(frozen=True)
class StepPoint:
    """One line of metrics.jsonl: an optimizer step completed."""

    step: int
    time: float
    plan: str
    peak_bytes: int | None = None
    capacity_bytes: int | None = None
    samples_per_s: float | None = None
    reserved_bytes: int | None = None  # a caching allocator's peak (None: what was allocated is what it held)
    loss: float | None = None

    @property
    def held_bytes(self) -> int | None:
        """What the step held of the device: reserved where an allocator keeps more."""
        return self.reserved_bytes if self.reserved_bytes is not None else self.peak_bytes


@dataclass(frozen=True)
class AttemptSeries:
    number: int
    plan: str  # the plan it started under (Plan.short())
    started_at: float
    ended_at: float | None  # None: still running (or not collected yet)
    end: float  # where its span ends in the figure: ended_at, else its last sign of life
    outcome_kind: str | None
    points: tuple[StepPoint, ...] = ()
    skipped_lines: int = 0  # metrics lines that could not be read (a truncated last line)
    note: str | None = None  # why there is nothing (or little) to draw for it
    error: str | None = None  # what a failed attempt died of (a crash: its exception line)

    @property
    def plans(self) -> tuple[str, ...]:
        """The plans it ran, in order (a probe or an in-process rung may change it)."""
        seen: list[str] = []
        for point in self.points:
            if not seen or seen[-1] != point.plan:
                seen.append(point.plan)
        return tuple(seen) or (self.plan,)

    @property
    def label(self) -> str:
        text = f"attempt {self.number} [{' -> '.join(self.plans)}]"
        if self.outcome_kind:
            text += f" {self.outcome_kind}"
        elif self.ended_at is None:
            text += " running"
        return text


@dataclass(frozen=True)
class OomMarker:
    attempt: int
    time: float
    bytes: int | None  # where on the memory axis: the cap it ran against, when known
    step: int
    kind: OomKind
    label: str


@dataclass(frozen=True)
class RungMarker:
    time: float
    attempt: int | None  # the attempt it happened in (runner) or after (daemon)
    source: RungSource
    label: str  # short, for a mark on the figure
    reason: str = ""  # why, in the doctor's or the runner's words (the dashboard lists it)


@dataclass(frozen=True)
class PlanRate:
    plan: str
    median_samples_per_s: float
    steps: int
    attempts: tuple[int, ...]
    samples_per_s: tuple[float, ...] = ()  # every step's, in order


@dataclass(frozen=True)
class ReportData:
    job_id: int
    name: str
    owner: str
    state: str
    result: str | None
    origin: float  # time zero of the figure: when the first attempt started
    attempts: tuple[AttemptSeries, ...]
    ooms: tuple[OomMarker, ...]
    rungs: tuple[RungMarker, ...]
    rates: tuple[PlanRate, ...]

    @property
    def title(self) -> str:
        return f"job {self.job_id} '{self.name}'  ·  {self.owner}  ·  {self.state}"

    @property
    def notes(self) -> tuple[str, ...]:
        notes = []
        for a in self.attempts:
            notes += [f"attempt {a.number}: {a.note}"] if a.note else []
            notes += [f"attempt {a.number} {a.outcome_kind}: {a.error}"] if a.error else []
        return tuple(notes)
