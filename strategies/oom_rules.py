"""The shapes of the lines in a training log that the OOM reader looks at.

Which lines frame an error (tracebacks, chain separators, warnings, shutdown noise) and the table of error
shapes (``RULES``: device and host OOMs, SIGKILL reports, launcher wrappers and the lookalikes that are not
OOMs), each with its category and a few words for the verdict's reason. strategies/oom_text.py scans a log
with them; why each rule is what it is is said in its docstring.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RANK_PREFIX = re.compile(r"^(?:\s*\[(?:rank|Rank|RANK)\s*\d+\]:?\s?)+")
# Only lines holding one of these are looked at; everything else is progress and chatter.
TRIGGER = re.compile(
    r"memory|error|exception|killed|sigkill|oom|exit|nccl|cudnn|cublas|resource_exhausted|bad_alloc|traceback|"
    r"above exception|plan failed|unable to find|executable batch|signal|allocat|can't open file|no module named",
    re.IGNORECASE,
)
CHAIN = re.compile(r"During handling of the above exception, another exception occurred|The above exception was the direct cause")
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
WARNING = re.compile(r"\w*Warning:|Triggered internally at|^\s*(?:W\d{4}\b|WARNING\b|\[W[\s\d])|NCCL (?:INFO|WARN)")
# Source lines that tracebacks quote: they name errors without raising them.
CODE = re.compile(r"^(?:raise|except|if|elif|assert|return|print)\b")
SHUTDOWN_NOISE = re.compile(r"^Exception ignored in|^Error in atexit\._run_exitfuncs")
MEMORY_EVIDENCE = re.compile(r"Plan failed with an? OutOfMemoryError")
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?::\s?(.*))?$")
# The line a traceback ends with, after its frames: a (dotted) class name, then ": message" or nothing. Any class:
# BrokenProcessPool and torch._dynamo.exc.Unsupported end in neither Error nor Exception.
RAISED = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*[a-z]\w*(?::|$)")
TRACEBACK_LINES = 500  # how far to look for the end of a traceback (Python folds repeated frames)


@dataclass(frozen=True)
class Rule:
    """A line shape: ``category`` says what it is, ``what`` names it for reasons."""

    pattern: re.Pattern[str]
    category: str  # device | host | sigkill | wrapper | cudnn_unsupported | nccl | error
    device: str | None = None
    what: str = ""


def _rule(pattern: str, category: str, device: str | None = None, what: str = "") -> Rule:
    return Rule(re.compile(pattern), category, device, what)


# First match wins, so the specific shapes come before the general ones.
RULES: tuple[Rule, ...] = (
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


GENERIC = Rule(EXCEPTION_LINE, "error")  # any other exception


def rule_for(line: str) -> Rule | None:
    """The first rule whose shape ``line`` has; ``GENERIC`` for any other exception line; None for other text."""
    stripped = line.strip()
    for rule in RULES:
        if rule.pattern.search(stripped):
            return rule
    if EXCEPTION_LINE.match(stripped):
        return GENERIC
    return None
