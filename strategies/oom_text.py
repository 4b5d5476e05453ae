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
  request (``oom_judge.is_fragmentation``, the doctor's rule too). Checked first, as the doctor does.
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

Where things live: this module scans a log and picks the error that decides (``read_oom``);
strategies/oom_rules.py holds the line shapes, strategies/oom_figures.py reads the sizes out of a
message, strategies/oom_judge.py judges a device OOM from them, and strategies/oom_verdict.py
holds the ``OomVerdict`` they make.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from os import PathLike
from typing import BinaryIO

from oomguard.strategies.oom_figures import ALLOC_WARNING, host_requested, nccl_requested, warning_figures
from oomguard.strategies.oom_judge import device_verdict, warning_verdict
from oomguard.strategies.oom_rules import (
    ANSI,
    CHAIN,
    CODE,
    GENERIC,
    MEMORY_EVIDENCE,
    RAISED,
    RANK_PREFIX,
    SHUTDOWN_NOISE,
    TRACEBACK,
    TRACEBACK_LINES,
    TRIGGER,
    WARNING,
    Rule,
    rule_for,
)
from oomguard.strategies.oom_verdict import OomVerdict
from oomguard.strategies.units import MiB, describe_size


# How much of a log file ``read_oom_log`` reads by default: its end holds the last error.
LOG_TAIL_BYTES = 4 * MiB


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


@dataclass
class _Event:
    line: int
    rule: Rule
    text: str  # the line, or the line with its continuation for sized messages


class _Reader:
    def __init__(self, text: str) -> None:
        self.lines = [RANK_PREFIX.sub("", ANSI.sub("", line)).rstrip() for line in text.splitlines()]
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
            if not line or exception is None and not TRIGGER.search(line):
                continue
            if self._mark(i, line):
                if self.tracebacks and self.tracebacks[-1] == i:
                    raised.update(self._raised(i))
                continue
            if SHUTDOWN_NOISE.search(line):
                noise_until = i + 40  # its traceback follows; the exception that ends it is noise
                continue
            if exception is None and WARNING.search(line):
                continue
            text = exception or line.strip()
            rule = rule_for(text) or (GENERIC if exception else None)
            # A quoted source line names errors without raising them, unless the error's own
            # output was glued to it (stderr interleaved with the traceback).
            if rule is None or CODE.match(text) and rule.category not in ("device", "host"):
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
            (CHAIN, self.chains), (TRACEBACK, self.tracebacks), (MEMORY_EVIDENCE, self.evidence),
            (ALLOC_WARNING, self.alloc_warnings),
        )
        for pattern, lines in marks:
            if pattern.search(line):
                lines.append(i)
                return True
        return False

    def _raised(self, i: int) -> dict[int, str]:
        """The exception the traceback starting at line ``i`` ends with, as {line: text}: the first line after its
        frames, without the prefix its "Traceback" line has (torchrun's "[default0]:", srun's "0: ")."""
        prefix = self.lines[i][: TRACEBACK.search(self.lines[i]).start()]  # type: ignore[union-attr]
        if i + 1 == len(self.lines) or not self.lines[i + 1].startswith(prefix):
            prefix = ""  # text glued in front of it, not a prefix of every line
        for j in range(i + 1, min(len(self.lines), i + TRACEBACK_LINES)):
            line = self.lines[j]
            if not line.startswith(prefix):
                continue  # another process's output interleaved with it
            line = line[len(prefix) :]
            if not line.strip() or line[0].isspace():
                continue  # its frames, the source lines they quote and their carets
            return {j: line.strip()} if RAISED.match(line) else {}
        return {}

    def _with_continuation(self, i: int, first: str) -> str:
        """The line (``first``: its text) and the lines that continue its message (wrapped or multi-line messages)."""
        parts = [first]
        for line in self.lines[i + 1 : i + 8]:
            stripped = line.strip()
            if not stripped or TRACEBACK.search(stripped) or CHAIN.search(stripped) or stripped.startswith("File "):
                break
            if rule_for(stripped) is not None:
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
            return warning_verdict(self.lines[final].strip())
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
            return OomVerdict(
                kind="oom", device="cuda", requested=nccl_requested(last.text), message=last.text,
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
        return last if all(not line.strip() or WARNING.search(line) for line in self.lines[last + 1 :]) else None

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
        w = warning_figures(self.lines[line])
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
            return OomVerdict(
                kind="host_oom", device="cpu", message=text, requested=host_requested(text),
                reason=f"{rule.what}{wrapped}",
            )
        verdict = device_verdict(rule.device, text)
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


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."

