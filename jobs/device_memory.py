"""Device memory capacity: emulated on the CPU, or enforced on a real GPU.

The project is tested without a GPU, so training runs for real on the CPU and only the
*capacity* of device memory is emulated. ``EmulatedDevice`` installs a
``TorchDispatchMode`` that sees every aten op (forward, backward, optimizer step,
activation-checkpoint recomputation), counts the bytes of each storage an op allocates,
releases them when the storage dies (weak references, as PyTorch's MemTracker does), and
raises ``torch.OutOfMemoryError`` worded like the CUDA caching allocator's when a
capacity is exceeded, so the code that survives real OOMs is exercised unchanged.

Two emulations (--emulate-allocator): *exact* counts live bytes against the capacity; *caching*
also hands every storage to a model of PyTorch's caching allocator (jobs/caching_allocator.py),
which rounds it, places it in a cached segment and refuses when what it must *reserve* would
pass the capacity (the per-process limit), so fragmentation and expandable segments act here
as on a card. The live-byte count goes on under both (the benchmark compares them).

On a machine with CUDA, ``limit_cuda_memory`` makes a big card behave like a small one,
and the OOMs are PyTorch's own.

One idea, one file (past 400 lines): the device's accounting, what feeds it (ops that
allocate; tensors a script sends to its device; storages FSDP resizes in place), the allocator
blocks behind it and the OOM it raises share the storage table and cannot be split without
exposing it (the OOM's wording is jobs/cuda_oom.py). The runner's view of
it is jobs/memory_cap.py.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any, NoReturn

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import arg_tree_leaves, tree_leaves

from oomguard.jobs.caching_allocator import AllocatorOutOfMemory, CachingAllocator
from oomguard.jobs.cuda_oom import OOMInfo, cuda_oom_message
from oomguard.jobs.emulated_allocator import AllocatorEmulation, expandable_segments
from oomguard.strategies.units import format_torch_size

__all__ = ["EmulatedDevice", "limit_cuda_memory"]

GroupsFn = Callable[[], Mapping[str, Iterable[torch.Tensor | None]]]

# Name of the breakdown entry for tracked bytes that no group claims.
ACTIVATIONS = "activations"


# How an op's outputs relate to its inputs, read once per op from its schema.
_FRESH = 0  # outputs are new tensors (they may still share storage, see _unsafe_view)
_VIEW = 1  # outputs alias inputs and nothing is written: views, detach, alias
_MUTATES = 2  # outputs alias inputs that the op writes: in-place, out=, set_, resize_

_OP_KINDS: dict[Any, int] = {}


def _op_kind(func: Any) -> int:
    kind = _OP_KINDS.get(func)
    if kind is None:
        schema = getattr(func, "_schema", None)
        if schema is None or not any(r.alias_info is not None for r in schema.returns):
            kind = _FRESH
        elif schema.is_mutable:
            kind = _MUTATES
        else:
            kind = _VIEW
        _OP_KINDS[func] = kind
    return kind


def _storage(t: Any) -> torch.UntypedStorage | None:
    """The tensor's storage, or None where there is no device memory behind it."""
    # Sparse and other non-strided layouts have no single storage to count.
    if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided:
        return None
    if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):  # the common case first: a plain tensor
        # A sharded model's DTensor: its memory is its local shard's. Ops on it run inside the
        # subclass, out of this mode's sight, so its outputs are counted here by their shard.
        # Its flattened attributes name the local tensor, and from torch 2.13 the device mesh
        # too (not a tensor): the one tensor among them holds the memory.
        names, _ = t.__tensor_flatten__()
        inner = [value for name in names if isinstance(value := getattr(t, name), torch.Tensor)]
        return _storage(inner[0]) if len(inner) == 1 else None
    try:
        return t.untyped_storage()
    except RuntimeError:  # wrapper tensor subclasses without a storage of their own
        return None


_STORAGE_RESIZE = torch.UntypedStorage.resize_


def _count_storage_resizes(device: EmulatedDevice | None) -> None:
    """Count ``UntypedStorage.resize_`` on ``device`` (None: stop). FSDP frees a gathered
    block's parameters and allocates them again by resizing their storage, which no tensor op
    (and so no dispatch mode) sees; a sharded model's memory would otherwise look as if every
    gathered block stayed."""
    if device is None:
        torch.UntypedStorage.resize_ = _STORAGE_RESIZE  # type: ignore[method-assign]
        return

    def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        if not device._paused and size > storage.nbytes():
            device._resized(storage, size)  # refused before it happens, as an allocation is
            result = _STORAGE_RESIZE(storage, size)
        else:
            result = _STORAGE_RESIZE(storage, size)
            if not device._paused:
                device._resized(storage, storage.nbytes())
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]


class _CapacityMode(TorchDispatchMode):
    def __init__(self, device: EmulatedDevice) -> None:
        super().__init__()
        self._device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        device = self._device
        if device._paused:
            return out
        kind = _op_kind(func)
        if kind == _FRESH:
            device._account_fresh(args, kwargs, out)
        elif kind == _MUTATES:
            device._account_resizes(out)
        return out


class _MovesMode(TorchFunctionMode):
    """Counts tensors that a script sends to its device with ``.to(device)`` (``Module.to``,
    ``accelerator.prepare``). Without a GPU the script's device is the CPU, so the call copies
    nothing and no op allocates: weights loaded from a file (safetensors maps them from disk,
    ``torch.load`` builds storages outside any op) would stay uncounted, and a pretrained model
    would fit anywhere. On a GPU that same call copies the weights into device memory.
    ``.cpu()`` is not counted: scripts call it to bring results back to the host."""

    def __init__(self, device: EmulatedDevice) -> None:
        super().__init__()
        self._device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.to and not self._device._paused and isinstance(out, torch.Tensor):
            target = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
            if target is not None and out.device.type == "cpu":
                self._device.move_in((out,))
        return out


class EmulatedDevice:
    """Counts the live bytes of tensor storages made under it and enforces ``capacity``.

    Use as a context manager around training. A storage is counted once, when an op
    first returns it without having received it as an input, and released when the
    storage itself dies (not when one of several tensors viewing it dies). Storages not
    made by an op under the mode are invisible until passed to :meth:`track`: tensors
    that exist before entering (parameters), tensors from ``torch.load`` (the unpickler
    makes the storages and ``set_`` attaches them) and tensors from Python data
    (``torch.tensor``, ``as_tensor``, ``from_numpy`` only show up as ``lift_fresh``,
    which returns its input). Backward ops are seen (autograd carries the mode along);
    ops that other threads start themselves are not (modes are thread-local).

    ``capacity`` (bytes, or None for unlimited) may be changed at any time; a capacity
    below the live bytes makes the next allocating op fail, like another process taking
    memory would. ``groups`` names consumers for the OOM breakdown, e.g.
    ``lambda: {"params": model.parameters(), "grads": [p.grad for p in ...]}``.

    ``count_moves`` also counts every tensor sent to the device with ``.to(device)`` (see
    :class:`_MovesMode`): for scripts that know nothing of this class. The built-in runner
    says what it moves itself (:meth:`move_in`), since it keeps offloaded state on the host.
    """

    def __init__(
        self,
        capacity: int | None,
        device_index: int = 0,
        groups: GroupsFn | None = None,
        count_moves: bool = False,
        allocator: AllocatorEmulation | None = None,
        expandable: bool | None = None,
    ) -> None:
        # With ``allocator``, a model of PyTorch's caching allocator decides what is reserved
        # and what is refused (jobs/caching_allocator.py); ``capacity`` is then PyTorch's
        # per-process limit (as limit_cuda_memory sets it on a card), and ``overhead`` bytes
        # of non-PyTorch memory (the CUDA context) come on top. ``expandable`` (None: as
        # $PYTORCH_ALLOC_CONF says, read once, as torch reads it) turns expandable segments on.
        self._caching: CachingAllocator | None = None
        self.overhead = 0
        if allocator is not None:
            self.overhead = allocator.overhead_bytes
            self._caching = CachingAllocator(
                None, allocator.sizes, expandable_segments() if expandable is None else expandable, fraction=True
            )
        # The card this process is on, for the OOM message (memory_cap sets it on an emulated
        # GPU): its total and what the other processes hold. None: the card is the capacity.
        self.card: tuple[int, int] | None = None
        self.capacity = capacity
        self.device_index = device_index
        self.groups = groups
        self.count_moves = count_moves
        self.last_oom: OOMInfo | None = None
        # id(storage) -> (weak reference to the storage, bytes counted for it). PyTorch
        # keeps one Python object per live storage (all tensors viewing it return the
        # same one), so the id is stable while it lives and the weak reference dies
        # exactly when the storage is freed.
        # The last element is the caching allocator's handle for the storage (None: exact).
        self._tracked: dict[int, tuple[weakref.ref[torch.UntypedStorage], int, int, int | None]] = {}
        # Storages counted since the last mark() carry this generation (mark() and held_before_mark()).
        self._live = 0
        self._peak = 0
        self._generation = 0
        self._oom_count = 0
        self._paused = 0
        self._mode: _CapacityMode | None = None
        self._moves: _MovesMode | None = None

    # -- public API -----------------------------------------------------------------

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int | None) -> None:
        if value is not None:
            value = operator.index(value)  # a byte count: int-like, never a float
            if value <= 0:
                raise ValueError(f"capacity must be positive bytes or None, got {value}")
        self._capacity = value
        if self._caching is not None:
            self._caching.limit = value

    @property
    def live_bytes(self) -> int:
        return self._live

    @property
    def peak_bytes(self) -> int:
        return self._peak

    @property
    def oom_count(self) -> int:
        return self._oom_count

    def reset_peak(self) -> None:
        self._peak = self._live
        if self._caching is not None:
            self._caching.reset_peak()

    @property
    def caching(self) -> bool:
        """Whether the caching allocator is emulated (else the figures below are the exact ones)."""
        return self._caching is not None

    @property
    def allocated_bytes(self) -> int:
        """torch.cuda.memory_allocated: block sizes, rounded up, with the caching allocator."""
        return self._caching.allocated if self._caching is not None else self._live

    @property
    def peak_allocated_bytes(self) -> int:
        return self._caching.peak_allocated if self._caching is not None else self._peak

    @property
    def reserved_bytes(self) -> int:
        """torch.cuda.memory_reserved: what the allocator holds from the card (the exact
        emulation reserves what is live)."""
        return self._caching.reserved if self._caching is not None else self._live

    @property
    def peak_reserved_bytes(self) -> int:
        return self._caching.peak_reserved if self._caching is not None else self._peak

    @property
    def alloc_stats(self) -> dict[str, int] | None:
        """torch.cuda.memory_stats()'s retry and OOM counts (None: the exact emulation)."""
        if self._caching is None:
            return None
        return {"num_alloc_retries": self._caching.num_alloc_retries, "num_ooms": self._caching.num_ooms}

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache: cached blocks go back to the card."""
        if self._caching is not None:
            self._caching.empty_cache()

    def mark(self) -> None:
        """Begin a new generation: storages counted from now on are younger than the mark."""
        self._generation += 1

    def held_before_mark(self) -> int:
        """Live bytes of the storages counted before the last :meth:`mark`: at a step's end,
        what outlived the step (weights, optimizer state) and not what the step made and its
        caller still holds (the last micro-batch's outputs)."""
        generation = self._generation
        return sum(entry[1] for entry in list(self._tracked.values()) if entry[2] < generation)

    def track(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Count storages that exist already; returns the bytes newly counted.

        Never raises for capacity: the runner calls this while setting up (model,
        optimizer state, a loaded checkpoint), and an OOM is only meaningful for an op
        that asks for memory; an over-full device fails on the next allocating op.
        Storages counted already, and ``None`` entries (e.g. missing grads), are skipped.
        """
        added = 0
        for t in tensors:
            st = _storage(t)
            if st is None or id(st) in self._tracked:
                continue
            nbytes = st.nbytes()
            self._add(st, nbytes, self._allocate_anyway(nbytes))
            added += nbytes
        return added

    def move_in(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Tensors made on the host arrive on the device (``model.to(device)``): counted one
        storage at a time, and refused with an OOM like any allocation when one does not fit."""
        for t in tensors:
            st = _storage(t)
            if st is None or id(st) in self._tracked:
                continue
            nbytes = st.nbytes()
            if self._caching is None and self._capacity is not None and self._live + nbytes > self._capacity:
                self._refuse(nbytes, self._capacity)
            self._add(st, nbytes, self._allocate(nbytes))

    def move_out(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Tensors go back to the host (``model.to("cpu")``, a no-op on this CPU): no longer
        counted, although their storages live on."""
        for t in tensors:
            st = _storage(t)
            entry = self._tracked.get(id(st)) if st is not None else None
            if entry is not None:
                self._release(id(st), entry[0])

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Ops inside are not counted (host-side work: data loading, serialization).

        Storages counted earlier are still released when they die.
        """
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __enter__(self) -> EmulatedDevice:
        if self._mode is not None:
            raise RuntimeError("this EmulatedDevice is already active")
        self._mode = _CapacityMode(self)
        self._mode.__enter__()
        _count_storage_resizes(self)
        if self.count_moves:
            self._moves = _MovesMode(self)
            self._moves.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        moves, self._moves = self._moves, None
        if moves is not None:
            moves.__exit__(*exc_info)
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc_info)
            _count_storage_resizes(None)

    # -- accounting (called by the mode after every op) --------------------------------

    def _add(self, st: torch.UntypedStorage, nbytes: int, handle: int | None = None) -> None:
        key = id(st)
        self._tracked[key] = (weakref.ref(st, partial(self._release, key)), nbytes, self._generation, handle)
        # A single augmented assignment: a weakref callback (which runs on any decref
        # of a storage) cannot interleave and lose its decrement.
        self._live += nbytes
        if self._live > self._peak:
            self._peak = self._live

    def _release(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        entry = self._tracked.get(key)
        if entry is not None and entry[0] is ref:
            del self._tracked[key]
            self._live -= entry[1]
            if entry[3] is not None:
                self._caching.free(entry[3])  # type: ignore[union-attr]

    def _account_fresh(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        outputs = (out,) if isinstance(out, torch.Tensor) else tree_leaves(out)
        new: dict[int, torch.UntypedStorage] = {}
        for t in outputs:
            st = _storage(t)
            if st is not None and id(st) not in self._tracked:
                new[id(st)] = st
        if not new:
            return
        # Some ops without alias annotations still return an input's storage
        # (_unsafe_view, or an op handing back an untracked input unchanged).
        for t in arg_tree_leaves(*args, **kwargs):
            st = _storage(t)
            if st is not None:
                new.pop(id(st), None)
        if not new:
            return
        sizes = [(st, st.nbytes()) for st in new.values()]
        if self._caching is not None:
            handles: list[int] = []
            try:
                for _, nbytes in sizes:
                    handles.append(self._allocate(nbytes))
            except torch.OutOfMemoryError:
                for handle in handles:  # the outputs allocated before the one refused die with the op
                    self._caching.free(handle)
                raise
            for (st, nbytes), handle in zip(sizes, handles):
                self._add(st, nbytes, handle)
            return
        requested = sum(nbytes for _, nbytes in sizes)
        capacity = self._capacity
        if requested and capacity is not None and self._live + requested > capacity:
            self._refuse(requested, capacity)
        for st, nbytes in sizes:
            self._add(st, nbytes)

    def _account_resizes(self, out: Any) -> None:
        # In-place and out= ops can grow a storage they were handed (resize_ on an
        # out= tensor); count the growth of storages we already track.
        outputs = (out,) if isinstance(out, torch.Tensor) else tree_leaves(out)
        for t in outputs:
            st = _storage(t)
            if st is None:
                continue
            self._resized(st, st.nbytes())

    def _resized(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """A tracked storage now holds ``nbytes`` (refused, as an OOM, beyond the capacity)."""
        entry = self._tracked.get(id(st))
        if entry is None or entry[0]() is not st:
            return
        growth = nbytes - entry[1]
        if growth == 0:
            return
        handle = entry[3]
        if self._caching is not None:
            # A storage resized is a new block and the old one freed (as c10 reallocates).
            handle = self._allocate(nbytes)
            if entry[3] is not None:
                self._caching.free(entry[3])
        capacity = self._capacity
        if self._caching is None and growth > 0 and capacity is not None and self._live + growth > capacity:
            self._refuse(growth, capacity)
        self._tracked[id(st)] = (entry[0], nbytes, entry[2], handle)
        self._live += growth
        if self._live > self._peak:
            self._peak = self._live

    def _allocate(self, nbytes: int) -> int | None:
        """The caching allocator's block for a new storage (None: the exact emulation); its
        refusal is PyTorch's OOM."""
        if self._caching is None:
            return None
        try:
            return self._caching.malloc(nbytes)
        except AllocatorOutOfMemory as error:
            refused = error.oom.requested
        # Raised outside the except block: raised inside it, the OOM's traceback would hold
        # the allocator's error, whose traceback holds this frame, a cycle that keeps the op's
        # frames (and the storages they name) alive until the garbage collector runs.
        self._refuse_caching(refused)

    def _allocate_anyway(self, nbytes: int) -> int | None:
        """A block for a storage that exists already (``track``): never refused, as the exact
        emulation never refuses one; an over-full device fails at the next allocation."""
        if self._caching is None:
            return None
        limit, self._caching.limit = self._caching.limit, None
        try:
            return self._caching.malloc(nbytes)
        finally:
            self._caching.limit = limit

    def _refuse_caching(self, requested: int) -> NoReturn:
        """The caching allocator refused ``requested`` bytes: PyTorch's OOM with its figures."""
        caching = self._caching
        assert caching is not None
        allocated, reserved = caching.allocated, caching.reserved
        in_use = reserved + self.overhead
        if self.card is not None:  # an emulated GPU: the limit is a fraction of the card
            total, others = self.card
            allowed = self._capacity
        else:  # alone on a card that is the capacity and the overhead
            total, others, allowed = (self._capacity or reserved) + self.overhead, 0, None
        free = max(total - others - in_use, 0)
        message = cuda_oom_message(
            requested=requested, total=total, free=free, allocated=allocated, reserved=reserved,
            device_index=self.device_index, in_use=in_use, allowed=allowed,
        )
        self._oom_count += 1
        self.last_oom = OOMInfo(
            requested=requested, allocated=allocated, reserved=reserved, free=free, total=total,
            breakdown=self._breakdown(), message=message, alloc_stats=self.alloc_stats,
        )
        raise torch.OutOfMemoryError(message)

    def _refuse(self, requested: int, capacity: int) -> None:
        allocated = self._live
        reserved = allocated  # no caching allocator is emulated
        free = max(capacity - reserved, 0)
        message = cuda_oom_message(
            requested=requested,
            total=capacity,
            free=free,
            allocated=allocated,
            reserved=reserved,
            device_index=self.device_index,
        )
        self._oom_count += 1
        self.last_oom = OOMInfo(
            requested=requested,
            allocated=allocated,
            reserved=reserved,
            free=free,
            total=capacity,
            breakdown=self._breakdown(),
            message=message,
        )
        raise torch.OutOfMemoryError(message)

    def _breakdown(self) -> dict[str, int]:
        """Tracked bytes per group; a storage counts for the first group naming it."""
        tracked = dict(self._tracked)  # weakref callbacks may fire while we look
        claimed: set[int] = set()
        breakdown: dict[str, int] = {}
        groups = self.groups() if self.groups is not None else {}
        for name, tensors in groups.items():
            total = 0
            for t in tensors:
                st = _storage(t)
                if st is None:
                    continue
                key = id(st)
                entry = tracked.get(key)
                if entry is None or key in claimed:
                    continue
                claimed.add(key)
                total += entry[1]
            breakdown[name] = breakdown.get(name, 0) + total
        rest = sum(entry[1] for key, entry in tracked.items() if key not in claimed)
        breakdown[ACTIVATIONS] = breakdown.get(ACTIVATIONS, 0) + rest
        return breakdown


def limit_cuda_memory(capacity: int, device_index: int = 0) -> None:
    """Make CUDA device ``device_index`` refuse allocations beyond ``capacity`` bytes.

    Uses the caching allocator's per-process memory fraction, so a big card behaves like
    a small one and the OOMs (and their messages, with an "allowed" part) are PyTorch's.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if not torch.cuda.is_available():
        raise RuntimeError("limit_cuda_memory needs a CUDA device; use EmulatedDevice without one")
    total = torch.cuda.get_device_properties(device_index).total_memory
    if capacity > total:
        raise ValueError(
            f"cannot limit GPU {device_index} to {format_torch_size(capacity)}: "
            f"it has only {format_torch_size(total)}"
        )
    torch.cuda.set_per_process_memory_fraction(capacity / total, device_index)
