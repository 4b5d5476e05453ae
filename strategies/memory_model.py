"""The memory model: from measured peaks, the peak a plan would reach and how fast it would run.

(Past 400 lines: peaks and speeds are fitted the same way from the same measurements and
shapes; the speed half shares the shape lookup and the cached lines.)

For one *shape* (every knob but the micro-batch) the peak of a training step is close to a
straight line in the micro-batch:

    peak = fixed + per_sample * micro_batch

where ``fixed`` holds parameters, gradients and optimizer state (the static consumers) plus a
small transient. A peak is what the plan held of the device: with a caching allocator (a card,
or --emulate-allocator caching) what it *reserved*, so the line carries the allocator's reserve
(rounding, cached blocks it could not reuse), which grows with the micro-batch, and the safety
margins stay margins; elsewhere what was allocated. Two measured micro-batch sizes give the line; one measurement and the static
bytes give it too. A shape that has not run is predicted from the closest one that has, by
what each knob does to the consumers (e.g. checkpointing keeps ~60% of the activations of a
diffusers UNet, optimizer offload moves all optimizer state to host memory). Predictions
from another shape get a wider safety margin than lines fitted to the shape itself.

Speed works the same way: the time of one step is ``micro_batches * per_micro + batch *
per_sample`` (fixed cost per forward/backward, plus cost per sample); two measured sizes
give both terms, and knobs scale them by factors measured on this project's trainers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan
from oomguard.strategies.static_bytes import EMA_SIZE, StaticBytes, first_given, frozen_sizes, full_parameter_bytes, static_bytes, terms_of

# What each knob does to activations, time and the static consumers is its rung's
# MemoryTerms (strategies/rungs/); this module only combines them.

# With one timed micro-batch size, the share of its time assumed not to grow with its size.
SINGLE_SIZE_FIXED_SHARE = 0.5

# Predicted peaks must stay this far under the capacity: a line fitted to the shape itself
# is good to a few percent; a prediction carried over from another shape is rougher.
MARGIN_MEASURED = 0.08
MARGIN_PREDICTED = 0.15
# A plan whose own step was measured: only run-to-run jitter (allocator, a longer caption,
# another timestep) is left, so a small margin is enough.
MARGIN_RAN = 0.03
@dataclass(frozen=True)
class Measurement:
    """What one plan did on the device.

    ``fits``: a whole step ran and ``peak_bytes`` is its steady peak (optimizer state
    included), in bytes allocated; ``reserved_bytes`` the most its caching allocator held
    from the card meanwhile (None where the device reserves what it allocates: the exact
    emulation, or not known). Otherwise the plan ran out of memory and ``peak_bytes`` is the
    bytes in use plus the failed request, a lower bound of its peak at ``capacity``.
    ``static`` holds the bytes of ``parameters`` (on the device), ``trainable`` parameters
    and device ``optimizer_state`` when the runner knew them; for a command job's script, the
    ``resident`` bytes it held between steps.
    """

    plan: Plan
    fits: bool
    peak_bytes: int
    capacity: int | None = None
    samples_per_s: float | None = None
    static: dict[str, int] = field(default_factory=dict)
    step: int | None = None
    reserved_bytes: int | None = None

    @property
    def held_bytes(self) -> int:
        """What the plan took of the card: reserved where known, else allocated."""
        return self.reserved_bytes if self.reserved_bytes is not None else self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["plan"] = self.plan.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["plan"] = Plan.from_dict(data["plan"])
        values["static"] = dict(values.get("static") or {})
        return cls(**values)


def _set_aside(plan: Plan, roles: tuple[str, ...]) -> Plan:
    """The plan with the knobs of the rungs of ``roles`` at their defaults."""
    for r in rungs.ladder():
        if r.role in roles and r.get(plan) != r.default:
            plan = r.set(plan, r.default)
    return plan


# The planner asks for the shape of every candidate, a hundred thousand of them for a
# text-to-image job with every rung allowed: kept for that many.
_PLANS_KEPT = 1 << 17


@functools.lru_cache(maxsize=_PLANS_KEPT)
def shape_of(plan: Plan) -> Plan:
    """The plan with micro-batch and allocator (the batch and process rungs) set aside: what
    the peak line depends on. (Kept for the plans seen last: the planner asks it for thousands
    of candidates.)"""
    return _set_aside(plan, ("batch", "process"))


@functools.lru_cache(maxsize=_PLANS_KEPT)
def _without_process_knobs(plan: Plan) -> Plan:
    """The plan as far as its memory goes: process settings (the allocator) set aside."""
    return _set_aside(plan, ("process",))


def _activation_factor(plan: Plan, observed: dict[str, float] | None = None) -> float:
    """The product of the activation factors of the rungs ``plan`` has on: a rung's factor as
    ``observed`` on this job's measurements where there is one, else as its terms say."""
    observed = observed or {}
    return math.prod(observed.get(r.name, terms.activation) for r in rungs.ladder() if (terms := r.memory(plan)) is not None)


# An observed factor is kept within these bounds (two noisy lines could give any ratio).
OBSERVED_FACTOR_RANGE = (0.05, 1.5)


def observed_activation_factors(lines: dict[Plan, Line]) -> dict[str, float]:
    """Each shape rung's activation factor on this job, where two fitted lines differ in that
    rung alone: the per-sample slope with it over the slope without it. The rungs' own factors
    are rounded from this project's UNet2DModel; gradient checkpointing, for one, keeps about
    twice as much of its activations as of a Stable Diffusion UNet's."""
    observed: dict[str, float] = {}
    for without, low in lines.items():
        for with_rung, high in lines.items():
            differing = [r for r in rungs.ladder() if r.role == "shape" and r.get(without) != r.get(with_rung)]
            if len(differing) != 1 or not differing[0].is_on(with_rung) or differing[0].is_on(without) or low.per_sample <= 0:
                continue
            lowest, highest = OBSERVED_FACTOR_RANGE
            observed.setdefault(differing[0].name, min(highest, max(lowest, high.per_sample / low.per_sample)))
    return observed


def time_factor(plan: Plan) -> float:
    return math.prod(terms.time for terms in terms_of(plan))


@dataclass(frozen=True)
class Line:
    """peak = fixed + per_sample * micro_batch for one shape; ``measured`` when fitted to
    runs of the shape itself."""

    fixed: float
    per_sample: float
    measured: bool
    # The one micro-batch the shape ran at, when its line rests on one size and the static
    # terms (None: two sizes or more, or not measured).
    one_size: int | None = None

    def peak(self, micro_batch: int) -> float:
        return self.fixed + self.per_sample * micro_batch


class MemoryModel:
    """Peaks and speeds of plans, from the measurements of a job's attempts and probes."""

    def __init__(self, measurements: Iterable[Measurement]) -> None:
        self.measurements = list(measurements)
        # Each measurement's plan with the allocator set aside (fits() compares with it).
        self._measured_as = [(m, _without_process_knobs(m.plan)) for m in self.measurements]
        self._lines: dict[Plan, Line] = {}
        # What line() and the speed lines work out for a shape, kept: the planner asks for
        # every micro-batch of every shape, and the model does not change once built.
        self._carried: dict[Plan, Line | None] = {}
        self._speed_lines: dict[tuple[Plan, bool], tuple[tuple[float, float], float] | None] = {}
        self._full_parameters: float | None = None
        self._frozen_sizes: dict[str, float] = {}
        self._trained_share = 1.0
        self._ema_size = 0.0
        # The static figures of the last measurement that named the model's size (what a rung
        # keeps on the host is read there: MemoryTerms.state_on_host_key).
        self._measured_static: dict[str, int] = {}
        for m in self.measurements:
            full = full_parameter_bytes(shape_of(m.plan), m.static)
            if full is not None:
                self._full_parameters = full
                self._frozen_sizes = frozen_sizes(m.static)
                self._ema_size = float(m.static.get(EMA_SIZE, 0))
                self._measured_static = m.static
                if first_given(t.adapter_share for t in terms_of(m.plan)) is None and m.static.get("trainable") is not None and full > 0:
                    self._trained_share = min(1.0, m.static["trainable"] / full)
        for shape in dict.fromkeys(shape_of(m.plan) for m in self.measurements):  # in measured order, not hash order
            line = self._fit(shape)
            if line is not None:
                self._lines[shape] = line
        self._observed = observed_activation_factors(self._lines)

    # -- memory -------------------------------------------------------------------------

    def _static(self, shape: Plan) -> StaticBytes | None:
        if self._full_parameters is None:
            return None
        return static_bytes(shape, self._full_parameters, self._frozen_sizes, self._trained_share, self._ema_size, self._measured_static)

    def _fit(self, shape: Plan) -> Line | None:
        runs = [m for m in self.measurements if m.fits and shape_of(m.plan) == shape]
        by_size: dict[int, int] = {}
        for m in runs:
            # What the plan held of the card: with a caching allocator, its reserve too.
            by_size[m.plan.micro_batch] = max(by_size.get(m.plan.micro_batch, 0), m.held_bytes)
        if len(by_size) >= 2:
            sizes = sorted(by_size)
            # Least squares over all sizes; the slope is never taken below zero.
            n = len(sizes)
            mean_x = sum(sizes) / n
            mean_y = sum(by_size[s] for s in sizes) / n
            var = sum((s - mean_x) ** 2 for s in sizes)
            slope = max(0.0, sum((s - mean_x) * (by_size[s] - mean_y) for s in sizes) / var)
            # Lift the line so that no measured peak lies above it.
            fixed = max(by_size[s] - slope * s for s in sizes)
            return self._respect_ooms(shape, Line(fixed, slope, measured=True))
        static = self._static(shape)
        # A command job's script reports what stays on its device between steps instead of
        # its parameters (jobs/script_report.py): that is the line's fixed part. It holds the
        # last micro-batch's outputs too, so it errs high, which keeps smaller micro-batches'
        # predictions above their true peaks.
        resident = max((m.static["resident"] for m in runs if "resident" in m.static), default=None)
        if len(by_size) == 1 and (static is not None or resident is not None):
            (size, peak), = by_size.items()
            fixed = static.total if static is not None else min(resident, peak)
            per_sample = max(0.0, (peak - fixed) / size)
            return self._respect_ooms(shape, Line(fixed, per_sample, measured=True, one_size=size))
        return None

    def _respect_ooms(self, shape: Plan, line: Line) -> Line:
        """An OOM of this shape at micro-batch m says peak(m) > the bytes it had: steepen the
        line until it agrees."""
        per_sample = line.per_sample
        for m in self.measurements:
            if not m.fits and shape_of(m.plan) == shape:
                size = m.plan.micro_batch
                if line.fixed + per_sample * size < m.peak_bytes:
                    per_sample = (m.peak_bytes - line.fixed) / size
        return Line(line.fixed, per_sample, line.measured, line.one_size)

    def line(self, shape: Plan) -> Line | None:
        """The peak line of ``shape``: fitted if it ran, else carried over from the closest
        shape that did."""
        shape = shape_of(shape)
        if shape in self._lines:
            return self._lines[shape]
        if shape not in self._carried:
            self._carried[shape] = self._carried_line(shape)
        return self._carried[shape]

    def _carried_line(self, shape: Plan) -> Line | None:
        if not self._lines:
            return self._from_oom_only(shape)
        reference = min(self._lines, key=lambda other: _distance(other, shape))
        ref_line = self._lines[reference]
        ref_static, static = self._static(reference), self._static(shape)
        per_sample = ref_line.per_sample * _activation_factor(shape, self._observed) / _activation_factor(reference, self._observed)
        if ref_static is None or static is None:
            return Line(ref_line.fixed, per_sample, measured=False)
        transient = max(0.0, ref_line.fixed - ref_static.total)
        return self._respect_ooms(shape, Line(static.total + transient, per_sample, measured=False))

    def _from_oom_only(self, shape: Plan) -> Line | None:
        """Nothing ran to the end: only the static bytes can be predicted, and the OOMs bound
        the activations from below."""
        static = self._static(shape)
        if static is None:
            return None
        per_sample = 0.0
        for m in self.measurements:
            known = self._static(shape_of(m.plan))
            if known is None:
                continue
            scale = _activation_factor(shape, self._observed) / _activation_factor(m.plan, self._observed)
            per_sample = max(per_sample, (m.peak_bytes - known.total) / m.plan.micro_batch * scale)
        return Line(static.total, per_sample, measured=False)

    def predicted_peak(self, plan: Plan) -> float | None:
        """What ``plan`` would hold of the device at its peak (with a caching allocator, what
        it would reserve)."""
        line = self.line(plan)
        return None if line is None else line.peak(plan.micro_batch)


    def fits(self, plan: Plan, capacity: int, *, optimistic: bool = False) -> bool | None:
        """Whether ``plan`` should fit ``capacity`` with a safety margin (None: no idea).

        ``optimistic`` asks whether it could fit at all (the smallest margin for every
        prediction): the probe measures such a plan to find out, the doctor never takes one.
        """
        key = _without_process_knobs(plan)
        for m, measured in self._measured_as:
            # What ran out of memory at this capacity or more does not fit now either.
            if not m.fits and measured == key and (m.capacity is None or m.capacity >= capacity):
                return False
        ran = [m.held_bytes for m, measured in self._measured_as if m.fits and measured == key]
        if ran:
            return max(ran) <= capacity * (1 - MARGIN_RAN)
        line = self.line(plan)
        if line is None:
            return None
        margin = MARGIN_RAN if optimistic else MARGIN_MEASURED if line.measured else MARGIN_PREDICTED
        if optimistic and line.one_size is not None and plan.world_size > 1:
            # On several processes the static terms are rough (gathered blocks, sharded
            # gradients held through a step's micro-batches): what one size measured above them
            # may be fixed cost, not activations. Measured: a sharded shape's peak at micro-batch
            # 4 below its peak at 1 (4.21 vs 4.56 MiB). Whether a larger micro-batch could fit is
            # then worth a measurement.
            return line.peak(line.one_size) <= capacity * (1 - margin)
        return line.peak(plan.micro_batch) <= capacity * (1 - margin)

    # -- speed --------------------------------------------------------------------------

    def expected_samples_per_s(self, plan: Plan, *, optimistic: bool = False) -> float | None:
        """From the step-time line of the plan's shape (so that one noisy timing cannot make
        more slices look faster than fewer), else from the closest timed shape's line and
        what the knobs cost. ``optimistic``: the faster of the two readings of a shape timed
        at one size only (the probe's question before it measures a second size)."""
        key = (shape_of(plan), optimistic)
        if key not in self._speed_lines:
            self._speed_lines[key] = self._speed_line(*key)
        if self._speed_lines[key] is None:
            return None
        (per_micro, per_sample), scale = self._speed_lines[key]
        # A step: each rank's slices of its share, all ranks at once; samples/s are the whole
        # batch's (what runs measure), so plans on more processes compare with fewer.
        seconds = (plan.grad_accum * per_micro + plan.per_rank_batch * per_sample) * scale
        return plan.batch_size / seconds if seconds > 0 else None

    def _speed_line(self, shape: Plan, optimistic: bool) -> tuple[tuple[float, float], float] | None:
        """Seconds per micro-batch and per sample of ``shape``, and the factor to scale them by."""
        timed = [m for m in self.measurements if m.fits and m.samples_per_s]
        if not timed:
            return None
        line = self._time_line_of(shape, timed, optimistic)
        if line is not None:
            return line, 1.0
        # Among shapes as near, the first measured (a set's order follows Plan hashes, which
        # differ between processes: two daemons would borrow different shapes).
        reference = min(dict.fromkeys(shape_of(m.plan) for m in timed), key=lambda other: _distance(other, shape))
        line = self._time_line_of(reference, timed, optimistic)
        assert line is not None
        return line, time_factor(shape) / time_factor(reference)

    def _time_line_of(self, shape: Plan, timed: list[Measurement], optimistic: bool) -> tuple[float, float] | None:
        """Seconds per micro-batch and per sample of ``shape``. With one timed size, the
        split between the two is borrowed from a shape timed at two sizes (the same model
        spends its time alike), else guessed.

        Borrowed, the split is scaled by how much slower (or faster) the shape's one timing
        is. Whether a rung's cost grows with the samples is what one size cannot tell: on a
        small model, gradient checkpointing's recomputation is mostly launches (a fixed cost
        per micro-batch), and scaling it into the per-sample time ranked micro-batch 8 with
        checkpointing at 0.54 of what it ran (bench/results/ladder-t2i.md). ``optimistic``
        also reads the difference as fixed cost (the reference's per-sample time kept) and
        takes whichever reading is faster at large sizes."""
        own = [m for m in timed if shape_of(m.plan) == shape]
        if not own:
            return None
        if len({m.plan.micro_batch for m in own}) >= 2:
            return _time_line(own)
        lined = dict.fromkeys(shape_of(m.plan) for m in timed if len({n.plan.micro_batch for n in timed if shape_of(n.plan) == shape_of(m.plan)}) >= 2)
        if not lined:
            return _time_line(own)
        reference = min(lined, key=lambda other: _distance(other, shape))
        per_micro, per_sample = _time_line([m for m in timed if shape_of(m.plan) == reference])
        size = own[0].plan.micro_batch
        seconds = min(m.plan.batch_size / m.samples_per_s for m in own if m.samples_per_s) / own[0].plan.grad_accum
        predicted = per_micro + per_sample * size
        k = seconds / predicted if predicted > 0 else 1.0
        scaled = (per_micro * k, per_sample * k)
        fixed_cost = seconds - per_sample * size
        if optimistic and fixed_cost > 0 and per_sample < scaled[1]:
            return fixed_cost, per_sample
        return scaled


def _time_line(runs: Sequence[Measurement]) -> tuple[float, float]:
    """Seconds per micro-batch and per sample, fitted to step times of one shape."""
    seconds: dict[int, float] = {}
    for m in runs:
        assert m.samples_per_s
        t = m.plan.batch_size / m.samples_per_s  # the step's time
        seconds[m.plan.micro_batch] = min(seconds.get(m.plan.micro_batch, t), t)
    # Per micro-batch sizes: time of one micro-batch = per_micro + size * per_sample.
    points = sorted((size, seconds[size] / _accum(runs, size)) for size in seconds)
    if len(points) >= 2:
        (x0, y0), (x1, y1) = points[0], points[-1]
        per_sample = max(0.0, (y1 - y0) / (x1 - x0))
        per_micro = max(0.0, y0 - per_sample * x0)
        return per_micro, per_sample
    (size, t), = points
    # One size only: assume half of a micro-batch's time is fixed cost. Small diffusion
    # models spend most of a slice on launching work (80-90 % at micro-batch 1 on this
    # project's UNets); big ones on the samples. Two measured sizes replace the guess.
    return SINGLE_SIZE_FIXED_SHARE * t, (1 - SINGLE_SIZE_FIXED_SHARE) * t / size


def _accum(runs: Sequence[Measurement], size: int) -> int:
    return next(m.plan.grad_accum for m in runs if m.plan.micro_batch == size)


def _distance(a: Plan, b: Plan) -> int:
    """How many knobs two shapes differ in."""
    return sum(r.get(a) != r.get(b) for r in rungs.ladder() if r.role == "shape")
