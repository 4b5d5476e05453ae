"""The Plan: every memory knob of one attempt, as one frozen value.

Rungs are pure functions Plan -> Plan; the runner configures model, optimizer and process
from a Plan and nothing else, so two attempts with equal Plans train identically.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

Attention = Literal["default", "sliced"]
Offload = Literal["none", "optimizer", "params"]
MixedPrecision = Literal["no", "bf16", "fp16"]
Optimizer = Literal["adamw", "adamw8bit", "adamw4bit"]
BaseQuantization = Literal["int8", "nf4"]

EXPANDABLE_SEGMENTS = "expandable_segments:True"


@dataclass(frozen=True)
class Plan:
    """How one attempt spends device memory.

    ``micro_batch`` is the largest slice of the per-rank batch that runs through forward and
    backward at once; ``grad_accum`` is the number of slices, so the last slice may be smaller
    (uneven splits are exact because each slice's loss is weighted by its share of samples).
    """

    batch_size: int
    micro_batch: int
    world_size: int = 1
    allocator: str = ""
    gradient_checkpointing: bool = False
    attention: Attention = "default"
    offload: Offload = "none"
    mixed_precision: MixedPrecision = "no"
    optimizer: Optimizer = "adamw"
    lora_rank: int | None = None
    base_quantization: BaseQuantization | None = None
    # The trainer runs grad_accum slices of micro_batch each and cannot weigh a smaller last
    # slice (a user's script given --train_batch_size and --gradient_accumulation_steps):
    # only micro-batches that divide the per-rank batch keep the effective batch.
    even_slices: bool = False
    # Knobs of rungs that Plan has no field for (a rung added in its own module alone), as
    # sorted (knob, value) pairs: hashable, and absent from to_dict while empty, so stored plans
    # and checkpoints read as before.
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.extra:
            object.__setattr__(self, "extra", tuple(sorted(dict(self.extra).items())))
        if self.batch_size < 1 or self.world_size < 1:
            raise ValueError(f"batch_size and world_size must be >= 1: {self}")
        if self.batch_size % self.world_size:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by world_size {self.world_size}")
        if not 1 <= self.micro_batch <= self.per_rank_batch:
            raise ValueError(f"micro_batch {self.micro_batch} must be in 1..{self.per_rank_batch}")
        if self.even_slices and self.per_rank_batch % self.micro_batch:
            raise ValueError(f"micro_batch {self.micro_batch} must divide the per-rank batch {self.per_rank_batch} (even slices)")

    @classmethod
    def initial(
        cls, batch_size: int, mixed_precision: MixedPrecision = "no", micro_batch: int | None = None, world_size: int = 1, even_slices: bool = False,
    ) -> Plan:
        """The plan a job starts with: each rank's whole share of the batch at once, nothing saved."""
        return cls(
            batch_size=batch_size, micro_batch=micro_batch or batch_size // world_size, world_size=world_size, mixed_precision=mixed_precision,
            even_slices=even_slices,
        )

    @property
    def per_rank_batch(self) -> int:
        return self.batch_size // self.world_size

    @property
    def grad_accum(self) -> int:
        return math.ceil(self.per_rank_batch / self.micro_batch)

    def micro_batch_choices(self) -> list[int]:
        """The micro-batches worth slicing this plan's batch into, smallest first: for each
        number of slices, the smallest micro-batch that makes that many (a larger one with as
        many slices runs as fast and only needs more memory: batch 16 gives 1, 2, 3, 4, 6, 8,
        16, not 5 or 7). For a plan of even slices, the divisors of the per-rank batch. About
        2 * sqrt(batch) sizes instead of batch: the planner weighs each with every shape."""
        batch = self.per_rank_batch
        if self.even_slices:
            return [size for size in range(1, batch + 1) if batch % size == 0]
        return sorted({-(-batch // slices) for slices in range(1, batch + 1)})

    def micro_batch_sizes(self, micro_batch: int | None = None) -> list[int]:
        """The slice sizes of one rank's batch, e.g. batch 10, micro 4 -> [4, 4, 2]; at
        ``micro_batch`` instead of the plan's when given (a bucket's own: strategies/bucket_spike.py)."""
        micro = min(micro_batch or self.micro_batch, self.per_rank_batch)
        full, rest = divmod(self.per_rank_batch, micro)
        return [micro] * full + ([rest] if rest else [])

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    def extra_value(self, knob: str, default: Any) -> Any:
        return dict(self.extra).get(knob, default)

    def with_extra(self, knob: str, value: Any, default: Any) -> Plan:
        """The plan with an extra knob set; a knob at its default is left out, so that a plan
        that never turned it equals one that turned it back."""
        extra = {k: v for k, v in self.extra if k != knob}
        if value != default:
            extra[knob] = value
        return self.replace(extra=tuple(extra.items()))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        del data["extra"]
        if self.extra:
            data["extra"] = dict(self.extra)
        data["grad_accum"] = self.grad_accum
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        if "extra" in values:
            values["extra"] = tuple(dict(values["extra"]).items())
        return cls(**values)

    def short(self) -> str:
        """One line for tables and logs, naming only what differs from the defaults: the
        micro-batch, the processes, then each rung's label in ladder order."""
        # Imported here: the rung modules import Plan.
        from oomguard.strategies import rungs

        parts = [f"mb={self.micro_batch}x{self.grad_accum}"]
        if self.world_size > 1:
            parts.append(f"{self.world_size} processes")
        parts += [label for r in rungs.ladder() if (label := r.label(self)) is not None]
        return " ".join(parts)
