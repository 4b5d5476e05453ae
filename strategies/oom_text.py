"""Reading out-of-memory errors from their text.

``read_oom`` takes one error message or a whole training log (thousands of lines of progress,
several errors, noise after the last one) and says what the job died of: a device OOM (plain,
fragmentation, or memory held by other processes), a host OOM, or something that is not an OOM
at all, with every figure the message gives, in bytes. Pure Python and no torch: the daemon
reads the output of runners that died without reporting, and ``oomguard diagnose`` reads any
log a user hands it.

The rules, and why:

- **The last fatal error decides.** A log can hold an OOM that a trainer caught and survived
  and, hours later, the NCCL error that killed the job: the verdict is the NCCL error. Within one
  chained traceback ("During handling of the above exception ...", "The above exception was the
  direct cause ...") the memory error wins wherever it stands, so a wrapper that catches an OOM
  and raises something else (accelerate, bitsandbytes, a trainer's own handler) does not hide
  it. Things that never decide: warnings (``UserWarning``, "Triggered internally at"), NCCL's
  INFO/WARN debug lines, launcher re-reports of a child's failure (accelerate's
  ``CalledProcessError ... returned non-zero exit status``, torchrun's ``ChildFailedError``),
  and tracebacks printed at interpreter shutdown ("Exception ignored in", "Error in
  atexit._run_exitfuncs"). Limitation: when one rank OOMs and another rank's NCCL watchdog times
  out after it, whichever is printed last wins; read that log per rank.
- **A traceback names its exception by its shape.** The exception a traceback ends with is the
  first line after its frames, whatever its class is called (``BrokenProcessPool`` and
  ``torch._dynamo.exc.Unsupported`` end in neither Error nor Exception), without the prefix its
  "Traceback" line carries on every line (torchrun --tee's "[default0]:", srun --label's "0: ";
  other processes' lines interleaved with it are skipped). An ordinary error is ``not_oom`` with
  its line quoted as the message, never "no error found". So is the interpreter refusing to start
  the script ("python3: can't open file '/x/train.py': [Errno 2] ...", "No module named ...").
- **Fragmentation compares numbers, not the hint.** PyTorch prints its "If reserved but
  unallocated memory is large ... expandable_segments" hint on every OOM; the verdict is
  ``oom_fragmentation`` only when the reserved-but-unallocated bytes are at least the failed
  request (the doctor's rule in ``is_fragmentation``). Checked first, as the doctor does.
- **Other processes need per-process figures.** PyTorch >= 2.1 lists the device's processes
  from NVML ("Process 1234 has 20.00 GiB memory in use", "Including non-PyTorch memory, this
  process has ..."). ``oom_other_process`` when the other processes (listed, plus device memory
  that neither free nor any listed process accounts for, beyond a small slack) hold more than
  this process and would have left room for the request. In a container NVML's pids do not match
  ours, so PyTorch lists this process as "Process N" too: with no "this process" line, the listed
  process whose use is at or a little above PyTorch's reserved bytes is taken to be this one.
  Messages without per-process figures (PyTorch < 2.1, XPU, MPS) are never ``oom_other_process``:
  memory missing from the totals there may be this process's own non-PyTorch memory; the reason
  says how much is unaccounted for.
- **A per-process cap is not a neighbour.** With ``set_per_process_memory_fraction`` the caching
  allocator's message says "X allowed;" (CUDA, HIP, XPU >= 2.9); when PyTorch's reserved bytes plus
  the request exceed it, the cap refused the request and the verdict is plain ``oom`` whatever other
  processes hold. The cudaMallocAsync backend (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``,
  ComfyUI's default) words it "Allocation on device 0 would exceed allowed memory. (out of memory)"
  with one figure a line (currently allocated, requested, device limit = capacity, free, "PyTorch
  limit"): always plain ``oom`` (no per-process or reserved figures to tell more), the cap named only
  when allocated plus requested reach a limit below the device's size (without a fraction the limit
  it prints is the whole device).
- **The message without its head.** "Tried to allocate X (GPU 0; ...)" and "Tried to allocate X.
  GPU 0 has a total capacity of ..." are the caching allocator's words even when a logger or a
  wrapper's re-raise dropped "CUDA out of memory." in front of them; CUDA unless they name HIP/XPU.
- **The allocator's warning on a failed allocation** (torch 2.13: "[W... CUDACachingAllocator.cpp:N]
  memory allocation failed with OOM on device 1 while trying to allocate B bytes (free: F, total: T).",
  or "expandable_segments: memory mapping failed with OOM ... while trying to map ...") is logged on
  every failed cudaMalloc, also those the allocator recovers from by freeing its cache and retrying,
  so on its own it decides nothing. It is an OOM with its figures when the log ends with it (nothing
  after it but blank lines and warnings: the process hung or was killed), and it gives its figures to
  a memory error just after it that has none (within 50 lines before its traceback): "CUDA error: out
  of memory", or the "NVML_SUCCESS == r INTERNAL ASSERT FAILED at .../CUDACachingAllocator.cpp" that
  PyTorch raises instead of OutOfMemoryError when NVML fails while it builds the OOM report
  (pytorch#112377, #185240), itself a device OOM.
- **Host OOM:** ``DefaultCPUAllocator`` ("can't allocate memory" / "not enough memory"),
  Python's ``MemoryError`` and numpy's ``_ArrayMemoryError``, ``std::bad_alloc`` (C++ ``new``
  failed: host RAM, or an absurd size from a bug, which is rare), the kernel's OOM killer
  ("Out of memory: Killed process", "oom-kill:", "invoked oom-killer"), a DataLoader worker
  "killed by signal: Killed", and reports that the job died of SIGKILL with nothing else said
  (a shell's "Killed" line, accelerate's "died with <Signals.SIGKILL: 9>", torchrun's
  "exitcode: -9", "exit code 137"): on a training box the kernel's OOM killer is by far the
  usual sender, and the reason says so and how to confirm it (``dmesg``).
- **cuDNN.** ``CUDNN_STATUS_ALLOC_FAILED`` is an OOM (cuDNN could not allocate). PyTorch appends
  "This error may appear if you passed in a non-contiguous input" to every
  ``CUDNN_STATUS_NOT_SUPPORTED``, which cuDNN also returns for shapes and batch sizes its kernels
  cannot handle (pytorch#1059, #2917, #31336) and, when PyTorch could not give a kernel the
  workspace it wanted, for memory; accelerate's batch-size finder calls it a "CUDNN SNAFU" and
  shrinks the batch either way. Here it is an OOM only with memory evidence: a device OOM in the
  same chained traceback, or a "Plan failed with an OutOfMemoryError" warning just before it;
  otherwise ``not_oom`` with the ambiguity in the reason (shrinking a job for a layout bug would
  only waste attempts). The same holds for cuDNN v8's "GET/FIND was unable to find an engine".
  "Unable to find a valid cuDNN algorithm to run convolution" is an OOM: PyTorch raises it after
  every algorithm's workspace allocation failed. ``CUDNN_STATUS_INTERNAL_ERROR`` is ``not_oom``:
  a catch-all (driver faults, bad installs, sometimes memory while loading kernels, pytorch#81620),
  better retried than shrunk for; ``CUDNN_STATUS_EXECUTION_FAILED`` is ``not_oom``.
- **Lookalikes that are not OOMs:** "an illegal memory access was encountered", "device-side
  assert triggered", "misaligned address", NCCL errors ("unhandled system error", timeouts) and
  any other exception. An NCCL error whose own "Last error:" is "Cuda failure 'out of memory'" is
  an OOM: NCCL could not allocate its buffers on a full device.
- **Units.** c10 prints KiB/MiB/GiB (powers of 1024) rounded to two decimals, so byte counts
  read back are within 0.005 of a unit. PyTorch's MPS allocator labelled its 1024-based figures
  "KB/MB/GB" (``MPSHeapAllocatorImpl::format_size``) before it switched to KiB/MiB/GiB, so in an
  MPS message GB means 2**30; elsewhere KB/MB/GB are powers of 1000.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from os import PathLike
from typing import Any, BinaryIO, Literal

from oomguard.strategies.outcome import MemoryFigures

VerdictKind = Literal["oom", "oom_fragmentation", "oom_other_process", "host_oom", "not_oom"]
DEVICE_OOM_KINDS: tuple[VerdictKind, ...] = ("oom", "oom_fragmentation", "oom_other_process")

KiB, MiB, GiB = 1024, 1024**2, 1024**3

# How much of a log file ``read_oom_log`` reads by default: its end holds the last error.
LOG_TAIL_BYTES = 4 * MiB


@dataclass(frozen=True)
class OomVerdict:
    """What a job died of, read from its error text. Sizes are bytes, None where not printed."""

    kind: VerdictKind
    device: str | None = None  # "cuda", "hip", "xpu", "mps", "xla", "cpu" (host RAM)
    gpu_index: int | None = None
    requested: int | None = None
    total: int | None = None  # device capacity
    free: int | None = None  # free on the device, as the driver reported it
    allocated: int | None = None  # by PyTorch's allocator (private pools included)
    reserved_unallocated: int | None = None
    process_in_use: int | None = None  # this process, non-PyTorch memory included
    other_processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes in use
    allowed: int | None = None  # set_per_process_memory_fraction's cap, MPS's high watermark
    private_pools: int | None = None  # allocated in private pools (CUDA graphs)
    message: str = ""  # the error line(s) the verdict is read from
    reason: str = ""  # one sentence: why this verdict

    @property
    def reserved(self) -> int | None:
        if self.allocated is None or self.reserved_unallocated is None:
            return None
        return self.allocated + self.reserved_unallocated

    @property
    def is_device_oom(self) -> bool:
        return self.kind in DEVICE_OOM_KINDS

    def memory_figures(self) -> MemoryFigures:
        """The figures as the doctor reads them (reserved = allocated + reserved-but-unallocated)."""
        return MemoryFigures(
            requested=self.requested, allocated=self.allocated, reserved=self.reserved, free=self.free, total=self.total
        )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["other_processes"] = {str(pid): used for pid, used in self.other_processes.items()}
        data["reserved"] = self.reserved
        return data


def read_oom(text: str) -> OomVerdict:
    """The verdict on ``text``: an error message or a whole log (see the module docstring)."""
    return _Reader(text).verdict()


def read_oom_log(path: str | PathLike[str], max_bytes: int = LOG_TAIL_BYTES) -> OomVerdict:
    """``read_oom`` on the last ``max_bytes`` of a log file (the whole file when smaller).

    Raises OSError when the file cannot be read.
    """
    with open(path, "rb") as f:
        return read_oom(read_tail(f, max_bytes))


def read_tail(f: BinaryIO, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``max_bytes`` of an open (seekable) log file, from its first whole line."""
    f.seek(0, 2)
    size = f.tell()
    f.seek(max(0, size - max_bytes))
    data = f.read(max_bytes)
    text = data.decode("utf-8", errors="replace")
    if size > max_bytes:
        text = text.partition("\n")[2]  # the first line is cut
    return text


def describe_size(n: int | None) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, e.g. "1.50 GiB"."""
    if n is None:
        return "?"
    for unit, scale in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


# Sizes ---------------------------------------------------------------------------------------

_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|byte|B|[KMGT]iB|[kKMGT]B)\b"
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


def size_bytes(number: str, unit: str, *, binary_kb: bool = False) -> int:
    """``("20.00", "MiB")`` -> 20971520. "KB/MB/GB/TB" are powers of 1000, or of 1024 with
    ``binary_kb`` (how PyTorch's MPS allocator printed them)."""
    if unit.lower() in ("b", "byte", "bytes"):
        return int(Decimal(number))
    base = 1024 if unit.lower().endswith("ib") or binary_kb else 1000
    return round(Decimal(number) * base ** _POWER[unit[0].lower()])


def _size(pattern: re.Pattern[str], text: str, *, binary_kb: bool = False) -> int | None:
    match = pattern.search(text)
    if match is None:
        return None
    return size_bytes(match.group("n"), match.group("u"), binary_kb=binary_kb)


def _sized(before: str, after: str = "") -> re.Pattern[str]:
    """A pattern for a size between two phrases, with the number and unit named n and u."""
    return re.compile(before + r"(?P<n>\d+(?:\.\d+)?)\s*(?P<u>bytes|byte|B|[KMGT]iB|[kKMGT]B)\b" + after, re.IGNORECASE)


# PyTorch's caching allocator, both wordings (c10/cuda/CUDACachingAllocator.cpp; HIP and XPU
# copy it). New (>= 2.1): "Tried to allocate X. GPU 0 has a total capacity of T of which F is
# free. [Process P has U memory in use. ...] [Including non-PyTorch memory, this process has U
# memory in use.] [A allowed; ]Of the allocated memory A is allocated by PyTorch, [with P
# allocated in private pools (e.g., CUDA Graphs), ]and R is reserved by PyTorch but unallocated."
# Old: "Tried to allocate X (GPU 0; T total capacity; A already allocated; F free; [C allowed; ]
# R reserved in total by PyTorch)", before 1.4 "... F free; C cached)".
_REQUESTED = _sized(r"Tried to allocate ")
_TOTAL_NEW = _sized(r"has a total capac(?:i)?ty of ")  # "capacty": a typo some versions printed
_GPU_NEW = re.compile(r"\bGPU\s+(\d+) has a total capac", re.IGNORECASE)
_FREE_NEW = _sized(r"of which ", r" is free")
_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use")
_THIS_PROCESS = _sized(r"this process has ", r" memory in use")
_ALLOWED = _sized(r"", r" allowed;")
_ALLOCATED_NEW = _sized(r"Of the allocated memory ", r" is allocated by PyTorch")
_PRIVATE_POOLS = _sized(r"with ", r" allocated in private pools")
_UNALLOCATED_NEW = _sized(r"and ", r" is reserved by PyTorch but unallocated")
_OLD_PARENS = re.compile(r"\(GPU\s+(\d+);([^)]*)\)")
_TOTAL_OLD = _sized(r"", r" total capac(?:i)?ty")
_ALLOCATED_OLD = _sized(r"", r" already allocated")
_FREE_OLD = _sized(r"", r" free\b")
_RESERVED_OLD = _sized(r"", r" reserved in total by PyTorch")
_CACHED_OLD = _sized(r"", r" cached")
# MPS (aten/src/ATen/mps/MPSAllocator.mm): "MPS backend out of memory (MPS allocated: A, other
# allocations: O[, max allowed: M]). Tried to allocate X on private pool."
_MPS_ALLOCATED = _sized(r"MPS allocated: ")
_MPS_OTHER = _sized(r"other allocations: ")
_MPS_ALLOWED = _sized(r"max allowed: ")
# jax/XLA: "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 7406166528 bytes." or
# "Failed to allocate request for 2.99GiB (3206250496B) on device ordinal 0".
_XLA_EXACT = re.compile(r"\((\d+)B\)")
_XLA_REQUEST = _sized(r"(?:trying to allocate|allocating|allocate request for) ")
_XLA_ORDINAL = re.compile(r"device ordinal (\d+)")
# PyTorch's cudaMallocAsync backend (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync,
# c10/cuda/CUDAMallocAsyncAllocator.cpp, mallocAsync), one figure a line: "Allocation on device 0 would exceed allowed
# memory. (out of memory)\nCurrently allocated     : A\nRequested               : X\nDevice limit            : T\n
# Free (according to CUDA): F\nPyTorch limit (set by user-supplied memory fraction)\n                        : L".
_ASYNC = re.compile(r"Allocation on device (\d+) would exceed allowed memory")
_ASYNC_ALLOCATED = _sized(r"Currently allocated\s*:\s*")
_ASYNC_REQUESTED = _sized(r"\bRequested\s*:\s*")
_ASYNC_TOTAL = _sized(r"Device limit\s*:\s*")
_ASYNC_FREE = _sized(r"Free \(according to \w+\)\s*:\s*")
_ASYNC_LIMIT = _sized(r"PyTorch limit[^:]*:\s*")
# The caching allocator's warning on every failed cudaMalloc (torch 2.13, c10 LOG(WARNING), pytorch#180946), and its
# expandable-segments form (cuMemCreate failed): "memory allocation failed with OOM on device 1 while trying to allocate
# 20971520 bytes (free: 15794176, total: 150111977472)." / "expandable_segments: memory mapping failed with OOM on device 0
# while trying to map 20971520 bytes (free: 5832704, total: 101975851008)".
_ALLOC_WARNING = re.compile(
    r"memory (?:allocation|mapping) failed with OOM on device (\d+) while trying to (?:allocate|map) (\d+) bytes "
    r"\(free: (\d+), total: (\d+)\)"
)
_HOST_REQUEST = re.compile(r"you tried to allocate (\d+) bytes")
_NUMPY_REQUEST = _sized(r"Unable to allocate ", r" for an array")
_NCCL_CALLOC = re.compile(r"Failed to CUDA calloc (\d+) bytes")


def _caching_allocator_figures(text: str, device: str | None) -> tuple[OomVerdict, list[str]]:
    """The figures of a caching-allocator message (kind still to be judged), and notes for the reason."""
    notes: list[str] = []
    requested = _size(_REQUESTED, text)
    old = _OLD_PARENS.search(text)
    if old is not None:
        parts = old.group(2)
        allocated = _size(_ALLOCATED_OLD, parts)
        reserved = _size(_RESERVED_OLD, parts)
        unallocated = _size(_CACHED_OLD, parts)  # before 1.4 "cached" was reserved minus allocated
        if unallocated is None and reserved is not None and allocated is not None and reserved >= allocated:
            unallocated = reserved - allocated
        return OomVerdict(
            kind="oom", device=device, gpu_index=int(old.group(1)), requested=requested, total=_size(_TOTAL_OLD, parts),
            free=_size(_FREE_OLD, parts), allocated=allocated, reserved_unallocated=unallocated,
            allowed=_size(_ALLOWED, parts + ";"), message=text,
        ), notes
    gpu = _GPU_NEW.search(text)
    total = _size(_TOTAL_NEW, text)
    allocated = _size(_ALLOCATED_NEW, text)
    unallocated = _size(_UNALLOCATED_NEW, text)
    this = _size(_THIS_PROCESS, text)
    others = {int(m.group(1)): size_bytes(m.group(2), m.group(3)) for m in _PROCESS.finditer(text)}
    # NVML answers "not available" on some systems (Windows under WDDM) and PyTorch prints it
    # as 16 EiB; a figure larger than the device is no figure.
    if total is not None:
        if this is not None and this > total:
            notes.append("the per-process figures are not usable (larger than the device)")
            this = None
        others = {pid: used for pid, used in others.items() if used <= total}
    if this is None and others and allocated is not None and unallocated is not None:
        pid = _own_entry(others, allocated + unallocated)
        if pid is not None:
            this = others.pop(pid)
            notes.append(f"process {pid} taken to be this one (its pid differs in a container)")
    return OomVerdict(
        kind="oom", device=device, gpu_index=int(gpu.group(1)) if gpu else None, requested=requested, total=total,
        free=_size(_FREE_NEW, text), allocated=allocated, reserved_unallocated=unallocated, process_in_use=this,
        other_processes=others, allowed=_size(_ALLOWED, text), private_pools=_size(_PRIVATE_POOLS, text), message=text,
    ), notes


def _own_entry(processes: dict[int, int], reserved: int) -> int | None:
    """The listed process that is this one: in use at or a little above PyTorch's reserved bytes
    (its CUDA context and non-PyTorch memory come on top)."""
    close = {pid: used - reserved for pid, used in processes.items() if 0 <= used - reserved <= max(2 * GiB, reserved // 4)}
    return min(close, key=lambda pid: close[pid]) if close else None


def _mps_figures(text: str) -> OomVerdict:
    allocated = _size(_MPS_ALLOCATED, text, binary_kb=True)
    other = _size(_MPS_OTHER, text, binary_kb=True)
    return OomVerdict(
        kind="oom",
        device="mps",
        requested=_size(_REQUESTED, text, binary_kb=True),
        allocated=allocated,
        process_in_use=allocated + other if allocated is not None and other is not None else None,
        allowed=_size(_MPS_ALLOWED, text, binary_kb=True),
        message=text,
    )


def _async_figures(text: str, device: str) -> OomVerdict:
    gpu = _ASYNC.search(text)
    return OomVerdict(
        kind="oom", device=device, gpu_index=int(gpu.group(1)) if gpu else None, requested=_size(_ASYNC_REQUESTED, text),
        total=_size(_ASYNC_TOTAL, text), free=_size(_ASYNC_FREE, text), allocated=_size(_ASYNC_ALLOCATED, text),
        allowed=_size(_ASYNC_LIMIT, text), message=text,
    )


def _warning_figures(text: str) -> OomVerdict:
    """The figures of the caching allocator's warning on a failed allocation (a line ``_ALLOC_WARNING`` matches)."""
    gpu, requested, free, total = (int(n) for n in _ALLOC_WARNING.search(text).groups())  # type: ignore[union-attr]
    return OomVerdict(kind="oom", device="cuda", gpu_index=gpu, requested=requested, free=free, total=total, message=text)


def _xla_figures(text: str) -> OomVerdict:
    exact = _XLA_EXACT.search(text)
    ordinal = _XLA_ORDINAL.search(text)
    return OomVerdict(
        kind="oom",
        device="xla",
        requested=int(exact.group(1)) if exact else _size(_XLA_REQUEST, text),
        gpu_index=int(ordinal.group(1)) if ordinal else None,
        message=text,
    )


# Judging device OOMs ---------------------------------------------------------------------------

# Device memory that neither "free" nor a listed process accounts for, below which it is read as
# driver overhead rather than another process.
def _slack(total: int) -> int:
    return min(512 * MiB, total // 20)


_DEVICE_WORDS = {"cuda": "GPU", "hip": "GPU", "xpu": "GPU", "mps": "MPS device", "xla": "XLA device"}


def _judge(v: OomVerdict, notes: Sequence[str] = ()) -> OomVerdict:
    """oom / oom_fragmentation / oom_other_process from the figures of a device OOM."""
    size = describe_size
    requested, unallocated, reserved = v.requested, v.reserved_unallocated, v.reserved
    note = "".join(f"; {n}" for n in notes)
    device = _DEVICE_WORDS.get(v.device or "", "device")
    if requested is not None and unallocated is not None and 0 < unallocated and unallocated >= requested:
        return dataclasses.replace(
            v,
            kind="oom_fragmentation",
            reason=f"PyTorch held {size(unallocated)} reserved but unallocated, at least the {size(requested)} it failed to "
            f"allocate: the memory is there but in pieces, which expandable segments fix{note}",
        )
    # c10 rounds to two decimals, so a request that meets the cap exactly was over it. The caching allocator counts
    # its reserved bytes against the cap, cudaMallocAsync its allocated bytes (it prints no reserved figure); a limit
    # that is the whole device (cudaMallocAsync prints one without a fraction) is no cap.
    counted = reserved if reserved is not None else v.allocated
    cap = v.allowed if v.allowed is not None and (v.total is None or v.allowed < v.total) else None
    if cap is not None and counted is not None and requested is not None and counted + requested >= cap:
        return dataclasses.replace(
            v,
            kind="oom",
            reason=f"PyTorch's {size(counted)} plus the {size(requested)} requested reach the per-process limit of "
            f"{size(v.allowed)} allowed (set_per_process_memory_fraction): the limit refused it, not a full {device}{note}",
        )
    # This process: NVML's figure, or at least what PyTorch reserved.
    ours = v.process_in_use if v.process_in_use is not None else reserved
    listed = sum(v.other_processes.values())
    unaccounted = None
    if v.total is not None and v.free is not None and ours is not None:
        unaccounted = v.total - v.free - ours - listed
    held, parts = listed, [f"process {pid} {size(used)}" for pid, used in list(v.other_processes.items())[:3]]
    if v.process_in_use is not None and unaccounted is not None and v.total and unaccounted > _slack(v.total):
        held += unaccounted
        parts.append(f"{size(unaccounted)} not accounted for")
    room = v.free is None or requested is None or v.free + held >= requested
    if ours is not None and held > ours and room:
        return dataclasses.replace(
            v,
            kind="oom_other_process",
            reason=f"other processes held {size(held)} of the {size(v.total)} {device} ({', '.join(parts)}) while this "
            f"process held {size(ours)}: without them the {size(requested)} would have fit{note}",
        )
    if requested is None and v.total is None:
        return dataclasses.replace(v, kind="oom", reason=f"the {device} ran out of memory (the message gives no sizes){note}")
    reason = f"tried to allocate {size(requested)} with {size(v.free)} free of {size(v.total)}"
    if v.process_in_use is not None:
        reason += f" and {size(ours)} in use by this process"
    elif reserved is not None:
        reason += f" and {size(reserved)} reserved by PyTorch"
    elif v.allocated is not None:
        reason += f" and {size(v.allocated)} allocated by PyTorch"
    if v.allowed is not None:
        reason += f" ({size(v.allowed)} allowed)"
    reason += ": the job needs less memory"
    if v.process_in_use is None and unaccounted is not None and v.total and unaccounted > min(GiB, v.total // 4):
        reason += (
            f"; {size(unaccounted)} of the {device} is in use outside PyTorch's allocator (by another process, or "
            "non-PyTorch memory in this one: the message has no per-process figures to tell which)"
        )
    return dataclasses.replace(v, kind="oom", reason=reason + note)


# Scanning a log -------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RANK_PREFIX = re.compile(r"^(?:\s*\[(?:rank|Rank|RANK)\s*\d+\]:?\s?)+")
# Only lines holding one of these are looked at; everything else is progress and chatter.
_TRIGGER = re.compile(
    r"memory|error|exception|killed|sigkill|oom|exit|nccl|cudnn|cublas|resource_exhausted|bad_alloc|traceback|"
    r"above exception|plan failed|unable to find|executable batch|signal|allocat|can't open file|no module named",
    re.IGNORECASE,
)
_CHAIN = re.compile(r"During handling of the above exception, another exception occurred|The above exception was the direct cause")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
_WARNING = re.compile(r"\w*Warning:|Triggered internally at|^\s*(?:W\d{4}\b|WARNING\b|\[W[\s\d])|NCCL (?:INFO|WARN)")
# Source lines that tracebacks quote: they name errors without raising them.
_CODE = re.compile(r"^(?:raise|except|if|elif|assert|return|print)\b")
_SHUTDOWN_NOISE = re.compile(r"^Exception ignored in|^Error in atexit\._run_exitfuncs")
_MEMORY_EVIDENCE = re.compile(r"Plan failed with an? OutOfMemoryError")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?::\s?(.*))?$")
# The line a traceback ends with, after its frames: a (dotted) class name, then ": message" or nothing. Any class:
# BrokenProcessPool and torch._dynamo.exc.Unsupported end in neither Error nor Exception.
_RAISED = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*[a-z]\w*(?::|$)")
_TRACEBACK_LINES = 500  # how far to look for the end of a traceback (Python folds repeated frames)


@dataclass(frozen=True)
class _Rule:
    """A line shape: ``category`` says what it is, ``what`` names it for reasons."""

    pattern: re.Pattern[str]
    category: str  # device | host | sigkill | wrapper | cudnn_unsupported | nccl | error
    device: str | None = None
    what: str = ""


def _rule(pattern: str, category: str, device: str | None = None, what: str = "") -> _Rule:
    return _Rule(re.compile(pattern), category, device, what)


# First match wins, so the specific shapes come before the general ones.
_RULES: tuple[_Rule, ...] = (
    # Device OOMs.
    _rule(r"\b(?:CUDA|HIP|XPU) out of memory\. Tried to allocate", "device"),
    _rule(r"MPS backend out of memory", "device", "mps"),
    _rule(r"(?:^|:\s*)(?:CUDA|HIP|XPU) out of memory\.?(?:\s|$)", "device"),
    # The caching allocator's message quoted without its "CUDA out of memory." head (a logger, a wrapper's re-raise).
    _rule(r"Tried to allocate \d[\d.]*\s*\w+(?: \(GPU \d+;|\. GPU \d+ has a total capac)", "device"),
    _rule(r"Allocation on device (?:\d+ )?would exceed allowed memory", "device", None,
          "PyTorch's cudaMallocAsync allocator refused an allocation beyond the memory allowed to it"),
    _rule(r"NVML_SUCCESS == .*INTERNAL ASSERT FAILED at \"[^\"]*CUDACachingAllocator\.cpp\"", "device", "cuda",
          "PyTorch's CUDA allocator ran out of device memory and failed an NVML query while reporting it (pytorch#112377)"),
    _rule(r"(?:CUDA|HIP) error: out of memory", "device", None, "a CUDA call outside PyTorch's allocator ran out of device memory"),
    _rule(r"cuda runtime error \(2\) : out of memory", "device", "cuda", "PyTorch's old THC allocator ran out of device memory"),
    _rule(r"CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|hipErrorOutOfMemory|HIP_ERROR_OutOfMemory", "device", None,
          "a CUDA driver allocation failed"),
    _rule(r"CUBLAS_STATUS_ALLOC_FAILED", "device", "cuda", "cuBLAS could not allocate its handle or workspace on the device"),
    _rule(r"CUDNN_STATUS_ALLOC_FAILED", "device", "cuda", "cuDNN could not allocate device memory"),
    _rule(r"Unable to find a valid cuDNN algorithm to run convolution", "device", "cuda",
          "PyTorch tried every cuDNN algorithm and none could get its workspace"),
    _rule(r"No executable batch size found, reached zero", "device", None,
          "accelerate's find_executable_batch_size halved the batch down to zero after out-of-memory errors"),
    _rule(r"RESOURCE_EXHAUSTED: (?:Out of memory|Failed to allocate)", "device", "xla"),
    # Host OOMs.
    _rule(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)", "host", "cpu",
          "PyTorch's CPU allocator could not get host memory (RAM), which the ladder does not save"),
    _rule(r"Out of memory: Kill(?:ed)? process|Memory cgroup out of memory|invoked oom-killer|\boom-kill:|oom_reaper: reaped",
          "host", "cpu", "the kernel's OOM killer killed the process because host RAM ran out"),
    _rule(r"std::bad_alloc", "host", "cpu", "a C++ allocation (std::bad_alloc) failed in host memory"),
    _rule(r"^(?:numpy\.[\w.]*\.)?(?:_ArrayMemoryError|MemoryError)\b", "host", "cpu",
          "Python could not allocate host memory (MemoryError)"),
    _rule(r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) is killed by signal: Killed", "host", "cpu",
          "a DataLoader worker was killed by SIGKILL, which is how the kernel's OOM killer ends a process when host RAM runs out"),
    _rule(r"^Killed\s*$|: line \d+: +\d+ Killed\b", "sigkill", None, "the shell reports the process was killed (SIGKILL)"),
    _rule(r"died with <Signals\.SIGKILL: 9>", "sigkill", None, "the launcher reports the process died with SIGKILL"),
    _rule(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\) received by PID", "sigkill", None, "torchrun reports a rank died with SIGKILL"),
    _rule(r"exit (?:code|status) 137\b", "sigkill", None, "the process exited with 137 (128 + SIGKILL)"),
    # Launchers re-reporting a child's failure: never the cause.
    _rule(r"CalledProcessError: Command|ChildFailedError|failed \(exitcode: \d+\)|ProcessRaisedException|ProcessExitedException",
          "wrapper"),
    # Not OOMs (some look like one).
    _rule(r"cuDNN error: CUDNN_STATUS_NOT_SUPPORTED|CUDNN_STATUS_NOT_SUPPORTED\. This error may appear|"
          r"(?:GET|FIND) was unable to find an engine", "cudnn_unsupported", "cuda"),
    _rule(r"NCCL error|nccl\w*Error|DistBackendError|Watchdog caught collective operation timeout|NCCL communicator was aborted",
          "nccl", "cuda", "NCCL (the collective-communication library) failed"),
    _rule(r"an illegal memory access was encountered", "error", "cuda",
          "a kernel read or wrote outside its memory: a bug or a faulty GPU, not a shortage of memory"),
    _rule(r"device-side assert triggered", "error", "cuda",
          "a kernel assertion failed (typically an index out of range, such as a label beyond the number of classes)"),
    _rule(r"misaligned address", "error", "cuda", "a kernel accessed a misaligned address: a bug, not a shortage of memory"),
    _rule(r"CUDNN_STATUS_EXECUTION_FAILED", "error", "cuda", "a cuDNN kernel failed to run"),
    _rule(r"CUDNN_STATUS_INTERNAL_ERROR", "error", "cuda",
          "cuDNN reported an internal error, a catch-all (driver or install faults, sometimes memory while loading kernels); "
          "oomguard retries it rather than shrinking the job"),
    _rule(r"CUDA error: ", "error", "cuda", "a CUDA error that is not about memory"),
    # CPython's own refusal to start the script (Modules/main.c, pymain_run_file / runpy).
    _rule(r"python[\w.]*(?:\.exe)?: (?:can't open file |No module named |Error while finding module specification )",
          "error", None, "the Python interpreter could not start the job's script (a wrong path, module name or "
          "working directory in the job's command)"),
)


@dataclass
class _Event:
    line: int
    rule: _Rule
    text: str  # the line, or the line with its continuation for sized messages


class _Reader:
    def __init__(self, text: str) -> None:
        self.lines = [_RANK_PREFIX.sub("", _ANSI.sub("", line)).rstrip() for line in text.splitlines()]
        self.events: list[_Event] = []
        self.chains: list[int] = []  # lines of "During handling ..." separators
        self.tracebacks: list[int] = []
        self.evidence: list[int] = []  # lines of "Plan failed with an OutOfMemoryError"
        self.alloc_warnings: list[int] = []  # lines of the caching allocator's warning on a failed allocation
        self._scan()

    # Scanning --------------------------------------------------------------------------------

    def _scan(self) -> None:
        noise_until = -1
        raised: dict[int, str] = {}  # line -> the exception a traceback ends with there, its line prefix removed
        for i, line in enumerate(self.lines):
            exception = raised.pop(i, None)
            if not line or exception is None and not _TRIGGER.search(line):
                continue
            if self._mark(i, line):
                if self.tracebacks and self.tracebacks[-1] == i:
                    raised.update(self._raised(i))
                continue
            if _SHUTDOWN_NOISE.search(line):
                noise_until = i + 40  # its traceback follows; the exception that ends it is noise
                continue
            if exception is None and _WARNING.search(line):
                continue
            text = exception or line.strip()
            rule = self._match(text) or (_GENERIC if exception else None)
            # A quoted source line names errors without raising them, unless the error's own
            # output was glued to it (stderr interleaved with the traceback).
            if rule is None or _CODE.match(text) and rule.category not in ("device", "host"):
                continue
            if i <= noise_until and rule.category == "error":
                noise_until = -1
                continue
            if rule.category == "wrapper":
                continue
            if rule.category in ("device", "nccl"):
                text = self._with_continuation(i, text)
            self.events.append(_Event(i, rule, text))

    def _mark(self, i: int, line: str) -> bool:
        """Record a line that frames errors without being one: a chain separator, a traceback's start, memory
        evidence, an allocator warning. True when ``line`` is one."""
        marks = (
            (_CHAIN, self.chains), (_TRACEBACK, self.tracebacks), (_MEMORY_EVIDENCE, self.evidence),
            (_ALLOC_WARNING, self.alloc_warnings),
        )
        for pattern, lines in marks:
            if pattern.search(line):
                lines.append(i)
                return True
        return False

    def _raised(self, i: int) -> dict[int, str]:
        """The exception the traceback starting at line ``i`` ends with, as {line: text}: the first line after its
        frames, without the prefix its "Traceback" line has (torchrun's "[default0]:", srun's "0: ")."""
        prefix = self.lines[i][: _TRACEBACK.search(self.lines[i]).start()]  # type: ignore[union-attr]
        if i + 1 == len(self.lines) or not self.lines[i + 1].startswith(prefix):
            prefix = ""  # text glued in front of it, not a prefix of every line
        for j in range(i + 1, min(len(self.lines), i + _TRACEBACK_LINES)):
            line = self.lines[j]
            if not line.startswith(prefix):
                continue  # another process's output interleaved with it
            line = line[len(prefix) :]
            if not line.strip() or line[0].isspace():
                continue  # its frames, the source lines they quote and their carets
            return {j: line.strip()} if _RAISED.match(line) else {}
        return {}

    def _match(self, line: str) -> _Rule | None:
        stripped = line.strip()
        for rule in _RULES:
            if rule.pattern.search(stripped):
                return rule
        if _EXCEPTION_LINE.match(stripped):
            return _GENERIC
        return None

    def _with_continuation(self, i: int, first: str) -> str:
        """The line (``first``: its text) and the lines that continue its message (wrapped or multi-line messages)."""
        parts = [first]
        for line in self.lines[i + 1 : i + 8]:
            stripped = line.strip()
            if not stripped or _TRACEBACK.search(stripped) or _CHAIN.search(stripped) or stripped.startswith("File "):
                break
            if self._match(stripped) is not None:
                break
            parts.append(stripped)
        text = " ".join(parts)
        # A second report of the same error (a logger repeating it) must not add its figures.
        first = re.search(r"out of memory", text, re.IGNORECASE)
        if first is not None:
            again = re.search(r"out of memory", text[first.end() :], re.IGNORECASE)
            if again is not None:
                text = text[: first.end() + again.start()]
        return text

    # Judging ---------------------------------------------------------------------------------

    def verdict(self) -> OomVerdict:
        final = self._final_warning()
        if final is not None:
            return _warning_verdict(self.lines[final].strip())
        if not self.events:
            return OomVerdict(kind="not_oom", reason="no error found in the text")
        incident = self._last_incident()
        memory = [e for e in incident if e.rule.category in ("device", "host")]
        if memory:
            return self._memory_verdict(memory[0], chained=memory[0] is not incident[-1])
        last = incident[-1]
        category = last.rule.category
        if category == "sigkill":
            return OomVerdict(
                kind="host_oom",
                device="cpu",
                message=last.text,
                reason=f"{last.rule.what} with no error of its own: on a training box that is almost always the kernel's "
                "OOM killer (host RAM ran out); `dmesg | grep -i oom` confirms it",
            )
        if category == "cudnn_unsupported":
            if self._mark_before(last, self.evidence) is not None:
                return OomVerdict(
                    kind="oom", device="cuda", message=last.text,
                    reason="cuDNN could not run the operation after an allocation failed just before it: the workspace "
                    "it needed did not fit in device memory",
                )
            return OomVerdict(
                kind="not_oom",
                device="cuda",
                message=last.text,
                reason="cuDNN does not support this operation as called and nothing shows memory running out: usually an "
                "input shape, layout or batch size its kernels cannot handle (PyTorch adds the non-contiguous hint to every "
                "such error), sometimes a workspace that did not fit, which would show an allocation failure next to it",
            )
        if category == "nccl" and re.search(r"Cuda failure '?out of memory", last.text, re.IGNORECASE):
            calloc = _NCCL_CALLOC.search(last.text)
            return OomVerdict(
                kind="oom", device="cuda", requested=int(calloc.group(1)) if calloc else None, message=last.text,
                reason="NCCL could not allocate its buffers: the device was out of memory",
            )
        if last.rule.what:
            reason = f"{last.rule.what}; a smaller plan will not help"
        else:
            reason = f"the job failed with `{_short(last.text)}`, which is not an out-of-memory error"
        return OomVerdict(kind="not_oom", device=last.rule.device, message=last.text, reason=reason)

    def _last_incident(self) -> list[_Event]:
        """The last event and the events chained to it ("During handling ..." between them)."""
        incident = [self.events[-1]]
        for earlier in reversed(self.events[:-1]):
            later = incident[0]
            if not any(earlier.line < c < later.line for c in self.chains):
                break
            incident.insert(0, earlier)
        return incident

    def _final_warning(self) -> int | None:
        """The allocator warning the log ends with (nothing after it but blank lines and warnings), if any."""
        if not self.alloc_warnings or self.events and self.events[-1].line > self.alloc_warnings[-1]:
            return None
        last = self.alloc_warnings[-1]
        return last if all(not line.strip() or _WARNING.search(line) for line in self.lines[last + 1 :]) else None

    def _mark_before(self, event: _Event, marks: list[int]) -> int | None:
        """The last of ``marks`` just before ``event``: before its traceback (or it) by at most 50 lines, and after
        the error before it."""
        start = max((t for t in self.tracebacks if t < event.line), default=event.line)
        earlier = [e.line for e in self.events if e.line < start]
        window_start = max(start - 50, earlier[-1] if earlier else -1)
        return max((line for line in marks if window_start < line < event.line), default=None)

    def _with_warning_figures(self, event: _Event, verdict: OomVerdict) -> OomVerdict:
        """A memory error that gives no sizes takes them from the allocator's warning just before it."""
        line = self._mark_before(event, self.alloc_warnings)
        if line is None:
            return verdict
        w = _warning_figures(self.lines[line])
        return dataclasses.replace(
            verdict,
            device=verdict.device or w.device,
            gpu_index=verdict.gpu_index if verdict.gpu_index is not None else w.gpu_index,
            requested=w.requested,
            free=w.free,
            total=w.total,
            reason=f"{verdict.reason}; just before it PyTorch's caching allocator warned that it could not get "
            f"{describe_size(w.requested)} with {describe_size(w.free)} free of {describe_size(w.total)}",
        )

    def _memory_verdict(self, event: _Event, chained: bool) -> OomVerdict:
        text, rule = event.text, event.rule
        wrapped = " (raised again as another error in the same traceback)" if chained else ""
        if rule.category == "host":
            requested = _HOST_REQUEST.search(text)
            return OomVerdict(
                kind="host_oom", device="cpu", message=text,
                requested=int(requested.group(1)) if requested else _size(_NUMPY_REQUEST, text),
                reason=f"{rule.what}{wrapped}",
            )
        verdict = _device_verdict(rule, text)
        if rule.what and verdict.requested is None and verdict.total is None:
            verdict = dataclasses.replace(verdict, reason=f"{rule.what} (the message gives no sizes)")
        if verdict.requested is None and verdict.total is None:
            verdict = self._with_warning_figures(event, verdict)
        elif rule.device == "mps" and verdict.kind == "oom":
            verdict = dataclasses.replace(
                verdict,
                reason=f"tried to allocate {describe_size(verdict.requested)} with {describe_size(verdict.process_in_use)} "
                "in use by this process"
                + (f" of {describe_size(verdict.allowed)} allowed by the MPS high watermark" if verdict.allowed else "")
                + ": the job needs less memory",
            )
        if wrapped:
            verdict = dataclasses.replace(verdict, reason=verdict.reason + wrapped)
        return verdict


_GENERIC = _Rule(_EXCEPTION_LINE, "error")


def _device_verdict(rule: _Rule, text: str) -> OomVerdict:
    """The judged figures of a device OOM's message, by the allocator that wrote it."""
    if rule.device == "mps":
        return _judge(_mps_figures(text))
    if rule.device == "xla":
        return _judge(_xla_figures(text))
    # The caching allocator's wordings are CUDA's unless they name HIP or XPU (ROCm builds run the same code).
    device = rule.device or _device_name(text)
    if _ASYNC.search(text):
        return _judge(_async_figures(text, device or "cuda"))
    if "Tried to allocate" in text:
        return _judge(*_caching_allocator_figures(text, device or "cuda"))
    return _judge(OomVerdict(kind="oom", device=device, message=text))


def _warning_verdict(text: str) -> OomVerdict:
    """The verdict on a log that ends with the caching allocator's warning on a failed allocation."""
    v = _warning_figures(text)
    return dataclasses.replace(
        v,
        reason=f"PyTorch's caching allocator warned that it could not get {describe_size(v.requested)} with "
        f"{describe_size(v.free)} free of {describe_size(v.total)} on GPU {v.gpu_index}, and the log ends there with no "
        "error after it (the process hung or was killed): the job needs less memory",
    )


def _device_name(text: str) -> str | None:
    match = re.search(r"\b(CUDA|HIP|XPU)\b", text)
    return match.group(1).lower() if match else None


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."

