"""The ranks of one attempt as the training loop sees them: who this process is, and the few
collectives by which the ranks agree (jobs/ranks.py starts them).

Every decision that changes what the ranks do next is rank 0's, passed to the others
(``from_main``): a plan change after an OOM, a step up, a checkpoint due by time. Flags any
rank may raise (a stop requested, an OOM before the gradients are averaged) are combined
(``any``), so that all ranks take the same branch and meet in the same collectives. A single
process is a group of one, whose collectives return their input: the loop has one code path.

The gradients of a data-parallel (unsharded) plan are averaged after the whole step's
backward, not inside it as DistributedDataParallel does: an OOM in one rank's forward or
backward then leaves the others at the check-in before the average, where all ranks learn of
it and recover together in-process. FSDP's collectives are inside forward and backward, so a
sharded plan's OOM ends its rank and the others are torn down (jobs/ranks.py).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from oomguard.jobs.ranks import RANK_ENV

T = TypeVar("T")
# How long a collective may wait for a rank before it fails (a rank that died is found by
# jobs/ranks.py in seconds; this only bounds a hang that nothing else ends).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class PeerOutOfMemory(Exception):
    """Another rank ran out of memory in this step (the ranks learn of it where they meet)."""


class RankGroup:
    """This process's rank among ``world_size`` (a group of one without torch.distributed)."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self._mesh: Any = None

    @classmethod
    def from_environment(cls) -> RankGroup:
        if RANK_ENV not in os.environ:
            return cls()
        return cls(int(os.environ[RANK_ENV]), int(os.environ["WORLD_SIZE"]))

    @property
    def solo(self) -> bool:
        return self.world_size == 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self) -> torch.device:
        """This rank's device: its own GPU of the attempt's (CUDA_VISIBLE_DEVICES lists them in
        rank order), or the CPU."""
        if torch.cuda.is_available():
            index = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def start(self, device: torch.device) -> None:
        if self.solo:
            return
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT)

    def close(self) -> None:
        import torch.distributed as dist

        # One process has a group only when layer offload started one (jobs/layer_offload.py).
        if dist.is_initialized():
            dist.destroy_process_group()

    def mesh(self, device: torch.device) -> Any:
        """The device mesh FSDP shards over: every rank, one dimension."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(device.type, (self.world_size,))
        return self._mesh

    # -- agreement -------------------------------------------------------------------------

    def from_main(self, value: T | Callable[[], T]) -> T:
        """Rank 0's value (a callable is called on rank 0 only), on every rank."""
        if self.main:
            value = value() if callable(value) else value
        if self.solo:
            return value  # type: ignore[return-value]
        import torch.distributed as dist

        box = [value if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def any(self, flags: Iterable[bool]) -> list[bool]:
        """For each flag: whether any rank raised it."""
        values = [int(flag) for flag in flags]
        return [bool(v) for v in self._reduce(values, "max")]

    def largest(self, value: int) -> int:
        return int(self._reduce([value], "max")[0])

    def smallest(self, value: int | None) -> int | None:
        """The least of the ranks' values (None: no rank has one): the device capacity the
        ranks' plan must fit is the smallest rank's."""
        least = -self._reduce([-(value if value is not None else float("inf"))], "max")[0]
        return None if least == float("inf") else int(least)

    def longest(self, seconds: float) -> float:
        """The longest of the ranks' times (a step takes as long as its slowest rank)."""
        return float(self._reduce([seconds], "max")[0])

    def first(self, value: T | None) -> T | None:
        """The value of the lowest rank that has one (not None)."""
        if self.solo:
            return value
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return next((v for v in gathered if v is not None), None)

    def check_in(self, failed: bool = False) -> None:
        """Where the ranks meet after a step's backward, before they average: raises
        PeerOutOfMemory on the ranks that did not fail when another did."""
        if self.any([failed])[0] and not failed:
            raise PeerOutOfMemory("another rank ran out of memory in this step")

    def step_end(self, loss: float, failed: bool = False) -> float:
        """Where the ranks meet at a step's end: the whole batch's loss (the mean of the
        ranks'), or PeerOutOfMemory on the ranks that did not fail when another did (in the
        average or the optimizer step)."""
        total, failures = self._reduce([loss, float(failed)], "sum")
        if failures and not failed:
            raise PeerOutOfMemory("another rank ran out of memory in this step's optimizer")
        return total / self.world_size

    def join_failed(self, before_average: bool) -> None:
        """Meet the other ranks where they wait after this rank failed in a step: at the check
        in when it failed before the average, else at the step's end."""
        if before_average:
            self.check_in(failed=True)
        else:
            self.step_end(0.0, failed=True)

    def barrier(self) -> None:
        if not self.solo:
            import torch.distributed as dist

            dist.barrier()

    def _reduce(self, values: list[float], how: str) -> list[float]:
        if self.solo:
            return values
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.SUM)
        return tensor.tolist()

    def _collective_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    # -- data parallelism ------------------------------------------------------------------

    def average_gradients(self, parameters: Iterable[torch.Tensor]) -> None:
        """Average the gradients of an unsharded model over the ranks, in place, in about
        BUCKETS buckets of one dtype (at most DistributedDataParallel's default size), each
        flattened and reduced in one collective. Per tensor, a UNet's hundreds of small
        collectives took twice as long on 4 ranks as the sharded plans' few large ones; one
        bucket of all gradients raised the peak of a model whose state dominates by a whole
        copy of its gradients (measured: 10.9 -> 12.4 MiB). A sixteenth costs 6 % of them."""
        if self.solo:
            return
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in parameters if p.grad is not None]
        limit = min(BUCKET_BYTES, max(1, sum(g.numel() * g.element_size() for g in grads) // BUCKETS))
        for bucket in _buckets(grads, limit):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat)
            flat /= self.world_size
            for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(averaged)
            del flat


# DistributedDataParallel's default bucket_cap_mb, and how many buckets a step's gradients
# are split into at most that size (see average_gradients).
BUCKET_BYTES = 25 * 2**20
BUCKETS = 16


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, grouped into runs of one dtype of at most ``limit`` bytes each (a
    larger tensor is a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        last = buckets[-1] if buckets else None
        if last is None or last[0].dtype != tensor.dtype or size + nbytes > limit:
            buckets.append([tensor])
            size = nbytes
        else:
            last.append(tensor)
            size += nbytes
    return buckets
