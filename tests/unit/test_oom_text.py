"""Reading OOMs from their text: real messages in tests/oom_messages/, the CLI, the supervisor.

Each file in tests/oom_messages/ is one message shape, taken from a public report (its first
lines say where) and headed by what it must be read as:

    # expect: KIND key=value ...

Keys: device, gpu, requested, total, free, allocated, unallocated (reserved but unallocated),
reserved (allocated + unallocated, for the old wording that prints the total), in_use (this
process), others (pid:size,...), allowed, pools (private pools). Sizes are written as PyTorch
prints them ("20.00MiB", "0bytes", "5.56GiB+1.10GiB"). Every figure not listed must be absent:
the parser must neither miss a number nor invent one.
"""

from __future__ import annotations

import json
import time
from decimal import Decimal
from pathlib import Path

import pytest

from oomguard.daemon.supervisor import outcome_without_report
from oomguard.strategies.oom_text import read_oom, read_oom_log
from oomguard.strategies.oom_verdict import OomVerdict

MESSAGES = Path(__file__).parents[1] / "oom_messages"
FIXTURES = sorted(MESSAGES.glob("*.txt"))
UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def load(path: Path) -> tuple[dict[str, str], str]:
    """(expectations, text) of a fixture: its leading "# " lines are the header."""
    lines = path.read_text().splitlines(keepends=True)
    end = next((i for i, line in enumerate(lines) if not line.startswith("# ")), len(lines))
    expect = next(line for line in lines[:end] if line.startswith("# expect:"))
    kind, *pairs = expect.removeprefix("# expect:").split()
    return {"kind": kind, **dict(pair.split("=", 1) for pair in pairs)}, "".join(lines[end:])


def expected_bytes(text: str) -> int:
    """"20.00MiB" -> bytes, computed apart from the parser; "a+b" adds."""
    total = 0
    for part in text.split("+"):
        unit = next(u for u in UNITS if part.endswith(u))
        total += round(Decimal(part.removesuffix(unit)) * UNITS[unit])
    return total


def test_there_are_enough_message_shapes() -> None:
    assert len(FIXTURES) >= 24
    for path in FIXTURES:
        header = [line for line in path.read_text().splitlines() if line.startswith("# ")]
        assert any(line.startswith("# source:") for line in header), f"{path.name} does not say where its text comes from"


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_message(path: Path) -> None:
    expect, text = load(path)
    verdict = read_oom(text)
    assert verdict.kind == expect["kind"], verdict.reason
    assert verdict.device == expect.get("device")
    assert verdict.gpu_index == (int(expect["gpu"]) if "gpu" in expect else None)
    sizes = {
        "requested": verdict.requested,
        "total": verdict.total,
        "free": verdict.free,
        "allocated": verdict.allocated,
        "in_use": verdict.process_in_use,
        "allowed": verdict.allowed,
        "pools": verdict.private_pools,
    }
    for key, value in sizes.items():
        assert value == (expected_bytes(expect[key]) if key in expect else None), key
    if "reserved" in expect:
        assert verdict.reserved == expected_bytes(expect["reserved"])
    else:
        assert verdict.reserved_unallocated == (expected_bytes(expect["unallocated"]) if "unallocated" in expect else None)
    others = dict(pair.split(":") for pair in expect["others"].split(",")) if "others" in expect else {}
    assert verdict.other_processes == {int(pid): expected_bytes(size) for pid, size in others.items()}
    assert verdict.reason and (verdict.message or verdict.reason == "no error found in the text")
    # The verdict is about the text, and says it in one sentence.
    assert "\n" not in verdict.reason


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_the_doctor_gets_the_figures(path: Path) -> None:
    verdict = read_oom(load(path)[1])
    figures = verdict.memory_figures()
    assert (figures.requested, figures.allocated, figures.free, figures.total) == (
        verdict.requested, verdict.allocated, verdict.free, verdict.total,
    )
    assert figures.reserved_unallocated == (verdict.reserved_unallocated if verdict.allocated is not None else None)
    json.dumps(verdict.to_dict())


def test_fragmentation_is_read_from_the_numbers_not_the_hint() -> None:
    # Every new-format message carries the expandable_segments hint; these two differ only in
    # whether the reserved-but-unallocated bytes cover the request.
    base = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {req}. GPU 0 has a total capacity of 23.65 GiB of "
        "which 11.06 MiB is free. Including non-PyTorch memory, this process has 23.60 GiB memory in use. Of the allocated "
        "memory 22.90 GiB is allocated by PyTorch, and 194.87 MiB is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
    assert read_oom(base.format(req="194.87 MiB")).kind == "oom_fragmentation"
    assert read_oom(base.format(req="194.88 MiB")).kind == "oom"


def test_a_long_log_is_read_for_its_last_error_quickly() -> None:
    expect, text = load(MESSAGES / "log_oom_then_shutdown_noise.txt")
    progress = "Steps:  12%|█▏        | 48/400 [01:02<07:36,  1.30s/it, loss=0.0913, lr=5e-6]\n"
    before, marker, after = text.partition("Traceback (most recent call last):")
    long_log = before + progress * 5000 + marker + after
    started = time.monotonic()
    verdict = read_oom(long_log)
    assert time.monotonic() - started < 5
    assert verdict.kind == expect["kind"] == "oom_fragmentation"
    assert verdict.requested == expected_bytes(expect["requested"])


def test_the_last_fatal_error_wins_over_an_oom_the_job_survived() -> None:
    verdict = read_oom(load(MESSAGES / "log_recovered_oom_then_nccl.txt")[1])
    assert verdict.kind == "not_oom"
    assert "DistBackendError" in verdict.message and "NCCL" in verdict.reason


def test_cudnn_not_supported_is_an_oom_only_with_memory_evidence() -> None:
    # Constructed: PyTorch's cuDNN v8 path warns "Plan failed with an OutOfMemoryError" for each
    # plan whose workspace did not fit before giving up; the fatal line is pytorch#11065's.
    fatal = "RuntimeError: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
    warning = (
        "/usr/lib/python3/site-packages/torch/nn/modules/conv.py:456: UserWarning: Plan failed with an OutOfMemoryError: "
        "CUDA out of memory. Tried to allocate 3.00 GiB. (Triggered internally at ../aten/src/ATen/native/cudnn/Conv_v8.cpp:924.)"
    )
    traceback = 'Traceback (most recent call last):\n  File "train.py", line 10, in <module>\n    loss.backward()\n'
    assert read_oom(traceback + fatal).kind == "not_oom"
    with_evidence = read_oom(warning + "\n  return F.conv2d(input, weight, bias)\n" + traceback + fatal)
    assert with_evidence.kind == "oom" and "workspace" in with_evidence.reason
    # A warning from long before the traceback (another step) is no evidence for this error.
    old = warning + "\n" + "Steps: 1%|\n" * 100 + traceback + fatal
    assert read_oom(old).kind == "not_oom"


def test_nccl_failing_to_allocate_is_an_oom() -> None:
    # Constructed: the shape of NVIDIA/nccl#1410 with the CUDA failure NCCL logs in NVIDIA/nccl#1235.
    text = (
        "[rank3]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\n"
        "[rank3]: ncclUnhandledCudaError: Call to CUDA function failed.\n"
        "[rank3]: Last error:\n"
        "[rank3]: Cuda failure 'out of memory'\n"
    )
    verdict = read_oom(text)
    assert verdict.kind == "oom" and verdict.device == "cuda" and "NCCL" in verdict.reason


def test_text_without_an_error() -> None:
    verdict = read_oom("Steps: 100%|██████████| 400/400 [08:12<00:00,  1.23s/it, loss=0.0531]\nsaved final model\n")
    assert verdict == OomVerdict(kind="not_oom", reason="no error found in the text")


def test_the_emulated_device_message_reads_back_exactly() -> None:
    from oomguard.jobs.cuda_oom import cuda_oom_message

    for requested, total, free, allocated, reserved in [
        (4 * 2**20, 100 * 2**20, 3879731, 100 * 2**20 - 3879731, 100 * 2**20 - 3879731),
        (36 * 2**20, 200 * 2**20, 0, 172 * 2**20, 200 * 2**20),
        (512, 48 * 2**20, 1024, 48 * 2**20 - 1024, 48 * 2**20 - 1024),
    ]:
        message = cuda_oom_message(requested=requested, total=total, free=free, allocated=allocated, reserved=reserved, device_index=1)
        verdict = read_oom(message)
        assert verdict.gpu_index == 1 and verdict.device == "cuda"
        figures = verdict.memory_figures()
        # c10's format rounds to two decimals of the unit it picks.
        for read, true in [(figures.requested, requested), (figures.total, total), (figures.free, free),
                           (figures.allocated, allocated), (figures.reserved, reserved)]:
            assert read is not None and abs(read - true) <= max(true, 1024) * 0.0001 + 0.005 * 2**20
        assert verdict.kind == ("oom_fragmentation" if reserved - allocated >= requested else "oom")


def test_read_oom_log_reads_the_tail_of_a_big_file(tmp_path: Path) -> None:
    expect, text = load(MESSAGES / "cuda_old_format.txt")
    log = tmp_path / "output.log"
    log.write_text("RuntimeError: an early error that is cut off\n" + "x" * 100_000 + "\n" + text)
    assert read_oom_log(log, max_bytes=4096).kind == "oom"
    assert read_oom_log(log).kind == "oom"
    with pytest.raises(OSError):
        read_oom_log(tmp_path / "missing.log")


# A per-process cap (set_per_process_memory_fraction) ----------------------------------------

# c10/cuda/CUDAMallocAsyncAllocator.cpp (mallocAsync), the backend:cudaMallocAsync allocator.
ASYNC_OOM = (
    "torch.OutOfMemoryError: Allocation on device {gpu} would exceed allowed memory. (out of memory)\n"
    "Currently allocated     : {allocated}\n"
    "Requested               : {requested}\n"
    "Device limit            : {total}\n"
    "Free (according to CUDA): {free}\n"
    "PyTorch limit (set by user-supplied memory fraction)\n"
    "                        : {limit}\n"
)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("", ""),
        ("Steps:  3%|▎         | 12/400 [00:31<16:40,  2.58s/it]\n", "\nwandb: Waiting for W&B process to finish...\n"),
        ("[rank3]: ", ""),  # only the first line carries the rank prefix here; the scanner strips it
        ("!!! Exception during processing !!! ", "Got an OOM, unloading all loaded models.\n"),
    ],
)
def test_the_cuda_malloc_async_allocator_refusing_is_a_plain_oom_with_its_figures(before: str, after: str) -> None:
    text = before + ASYNC_OOM.format(
        gpu=2, allocated="30.12 GiB", requested="2.50 GiB", total="79.15 GiB", free="40.01 GiB", limit="31.66 GiB"
    ) + after
    verdict = read_oom(text)
    assert verdict.kind == "oom" and verdict.device == "cuda" and verdict.gpu_index == 2
    assert (verdict.requested, verdict.allocated, verdict.total, verdict.free, verdict.allowed) == (
        expected_bytes("2.50GiB"), expected_bytes("30.12GiB"), expected_bytes("79.15GiB"), expected_bytes("40.01GiB"),
        expected_bytes("31.66GiB"),
    )
    assert verdict.reserved_unallocated is None and verdict.process_in_use is None and not verdict.other_processes
    assert "set_per_process_memory_fraction" in verdict.reason and "Allocation on device 2" in verdict.message


def test_a_cuda_malloc_async_limit_that_is_the_whole_device_is_no_cap() -> None:
    # Without a fraction PyTorch prints the device's size as its limit: the device was full, no cap refused it.
    verdict = read_oom(ASYNC_OOM.format(
        gpu=0, allocated="23.10 GiB", requested="1.00 GiB", total="23.65 GiB", free="312.00 MiB", limit="23.65 GiB"
    ))
    assert verdict.kind == "oom" and verdict.allowed == expected_bytes("23.65GiB")
    assert "set_per_process_memory_fraction" not in verdict.reason
    assert "23.10 GiB allocated by PyTorch" in verdict.reason


# The caching allocator's warning on a failed allocation (torch 2.13) --------------------------

WARNING_LINE = (
    "[W812 16:00:28.643448608 CUDACachingAllocator.cpp:3933] memory allocation failed with OOM on device 0 while trying "
    "to allocate 20971520 bytes (free: 15794176, total: 25250627584)."
)
TRACEBACK = 'Traceback (most recent call last):\n  File "train.py", line 10, in <module>\n    loss.backward()\n'


def test_an_allocator_warning_the_job_went_on_from_decides_nothing() -> None:
    progress = "Steps:  12%|█▏        | 48/400 [01:02<07:36,  1.30s/it, loss=0.0913]\n"
    assert read_oom(WARNING_LINE + "\n" + progress + "saved final model\n").reason == "no error found in the text"
    verdict = read_oom(WARNING_LINE + "\n" + TRACEBACK + "ValueError: bad shape\n")
    assert verdict.kind == "not_oom" and verdict.message == "ValueError: bad shape"


def test_an_allocator_warning_gives_its_figures_to_a_memory_error_without_sizes() -> None:
    verdict = read_oom(WARNING_LINE + "\n" + TRACEBACK + "RuntimeError: CUDA error: out of memory\n")
    assert verdict.kind == "oom" and verdict.device == "cuda" and verdict.gpu_index == 0
    assert (verdict.requested, verdict.free, verdict.total) == (20971520, 15794176, 25250627584)
    assert verdict.message == "RuntimeError: CUDA error: out of memory" and "warn" in verdict.reason
    # One from long before the error (another step) is not about it.
    far = read_oom(WARNING_LINE + "\n" + "Steps: 1%|\n" * 100 + TRACEBACK + "RuntimeError: CUDA error: out of memory\n")
    assert far.kind == "oom" and far.requested is None
    # A memory error with its own figures keeps them.
    own = read_oom(WARNING_LINE + "\n" + load(MESSAGES / "cuda_new_format.txt")[1])
    assert own.requested == read_oom(load(MESSAGES / "cuda_new_format.txt")[1]).requested != 20971520


# "Tried to allocate ..." without "CUDA out of memory." in front ----------------------------------


@pytest.mark.parametrize(
    "line",
    [
        # PyTorch >= 2.1's wording, as a wrapper quoted it.
        "RuntimeError: batch 3 failed: Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 23.65 GiB of which "
        "11.06 MiB is free. Including non-PyTorch memory, this process has 23.60 GiB memory in use. Of the allocated "
        "memory 22.90 GiB is allocated by PyTorch, and 4.87 MiB is reserved by PyTorch but unallocated.",
        # PyTorch 1.4-2.0's, as a logger printed it.
        "2023-01-05 10:11:12 ERROR train: Tried to allocate 20.00 MiB (GPU 0; 23.65 GiB total capacity; 22.90 GiB "
        "already allocated; 11.06 MiB free; 22.91 GiB reserved in total by PyTorch)",
    ],
)
def test_the_bare_tried_to_allocate_fragment_is_an_oom(line: str) -> None:
    verdict = read_oom("Steps:  9%|▉         | 36/400 [00:51<08:40]\n" + line + "\n")
    assert verdict.kind == "oom" and verdict.device == "cuda" and verdict.gpu_index == 0
    assert verdict.requested == 20 * 2**20 and verdict.total == expected_bytes("23.65GiB")


def test_a_warning_that_quotes_the_fragment_decides_nothing() -> None:
    warning = (
        "WARNING:root:skipping batch: Tried to allocate 1.72 GiB (GPU 0; 10.76 GiB total capacity; 4.01 GiB already "
        "allocated; 356.00 MiB free; 5.54 GiB cached)"
    )
    assert read_oom(warning + "\nsaved final model\n").kind == "not_oom"


# Ordinary Python errors -------------------------------------------------------------------------


def prefixed(prefix: str, text: str) -> str:
    return "".join(f"{prefix}{line}\n" for line in text.splitlines())


@pytest.mark.parametrize(
    ("text", "exception"),
    [
        (TRACEBACK + "FileNotFoundError: [Errno 2] No such file or directory: 'train.py'\n", "FileNotFoundError"),
        (TRACEBACK + "KeyError: 'pixel_values'\nwandb: 🚀 View run upbeat-sun-12 at: https://wandb.ai/a/b/runs/1\n",
         "KeyError"),
        # A class whose name does not end in Error, with the message of a pool whose worker was killed.
        (TRACEBACK + "concurrent.futures.process.BrokenProcessPool: A process in the process pool was terminated "
         "abruptly while the future was running or pending.\n", "BrokenProcessPool"),
        # torchrun --tee prefixes each line of a worker with "[<role><local rank>]:", srun --label with the task number.
        (prefixed("[default1]:", TRACEBACK + "ValueError: Instance images root doesn't exist."), "ValueError"),
        (prefixed("0: ", TRACEBACK + "torch._dynamo.exc.Unsupported: call_method UserDefinedObjectVariable"), "Unsupported"),
    ],
)
def test_a_traceback_ends_in_the_exception_it_names(text: str, exception: str) -> None:
    verdict = read_oom(text)
    assert verdict.kind == "not_oom"
    assert verdict.message.startswith(exception) or verdict.message.split(":")[0].endswith("." + exception)
    assert exception in verdict.reason and verdict.reason != "no error found in the text"


@pytest.mark.parametrize(
    ("fixture", "message"),
    [
        ("python_traceback_torchrun_prefix", "FileNotFoundError: [Errno 2] No such file or directory: '/data/captions.jsonl'"),
        ("python_cant_open_file",
         "/usr/bin/python3: can't open file '/srv/jobs/sdxl/train.py': [Errno 2] No such file or directory"),
        ("python_error", "ValueError: Instance images root doesn't exists."),
        ("allocator_warning_recovered", "KeyError: 'captions'"),
    ],
)
def test_an_ordinary_error_is_quoted(fixture: str, message: str) -> None:
    verdict = read_oom(load(MESSAGES / f"{fixture}.txt")[1])
    assert verdict.kind == "not_oom" and verdict.message == message
    assert verdict.reason != "no error found in the text"


@pytest.mark.parametrize(
    "line",
    [
        "python3: can't open file '/srv/train.py': [Errno 2] No such file or directory",
        "C:\\Users\\me\\miniconda3\\python.exe: can't open file 'C:\\\\jobs\\\\train.py': [Errno 2] No such file or directory",
        "/root/.pyenv/versions/3.11.7/bin/python3: No module named trainer",
        "/usr/bin/python3.10: Error while finding module specification for 'trainer.main' "
        "(ModuleNotFoundError: No module named 'trainer')",
    ],
)
def test_the_interpreter_refusing_to_start_the_script_is_read(line: str) -> None:
    verdict = read_oom(line + "\n")
    assert verdict.kind == "not_oom" and verdict.message == line and "interpreter" in verdict.reason


# The supervisor: a runner that died without outcome.json ---------------------------------------


@pytest.mark.parametrize(
    ("fixture", "returncode", "kind"),
    [
        ("host_kernel_oom_killer", -9, "host_oom"),
        ("cuda_new_format", 1, "oom"),
        ("cuda_new_format_fragmentation", 1, "oom"),
        ("illegal_memory_access", 1, "crashed"),
        ("python_error", None, "crashed"),
        ("python_traceback_torchrun_prefix", 1, "crashed"),
        ("allocator_warning_log_end", None, "oom"),
    ],
)
def test_an_unreported_end_is_read_from_the_output(tmp_path: Path, fixture: str, returncode: int | None, kind: str) -> None:
    (tmp_path / "output.log").write_text("attempt 1 of job tiny: plan mb=8x1\n" + load(MESSAGES / f"{fixture}.txt")[1])
    outcome = outcome_without_report(tmp_path, returncode)
    assert outcome.kind == kind
    assert outcome.exit_code == returncode
    if kind == "oom":
        verdict = read_oom(load(MESSAGES / f"{fixture}.txt")[1])
        assert outcome.memory == verdict.memory_figures() and outcome.memory.requested is not None
        assert outcome.message == verdict.message and "memory" in outcome.message.lower()
    if kind == "crashed":
        assert outcome.traceback_tail  # the error the output ends with, for the report


def test_an_unreported_end_without_output_keeps_the_exit_status(tmp_path: Path) -> None:
    assert outcome_without_report(tmp_path, -9).message == "the runner was killed by SIGKILL before it could report"
    (tmp_path / "output.log").write_text("attempt 1 of job tiny: plan mb=8x1\n")
    assert outcome_without_report(tmp_path, 3).kind == "oom"  # the runner's own exit code for an OOM
    assert outcome_without_report(tmp_path, None).kind == "crashed"


def test_a_failed_attempt_during_which_the_kernel_killed_for_memory_ran_out_of_host_memory(tmp_path: Path) -> None:
    killed = outcome_without_report(tmp_path, -9, oom_kills=1)
    assert killed.kind == "host_oom" and "OOM killer" in killed.message and killed.exit_code == -9
    (tmp_path / "output.log").write_text("attempt 2 of job tiny: plan mb=8x1 offload=optimizer\n")
    assert outcome_without_report(tmp_path, 1, oom_kills=2).kind == "host_oom"  # a launcher whose rank was killed
    assert outcome_without_report(tmp_path, -9, oom_kills=0).kind == "crashed"  # someone else's SIGKILL
    assert outcome_without_report(tmp_path, -9, oom_kills=None).kind == "crashed"  # the kernel does not say
    assert outcome_without_report(tmp_path, 0, oom_kills=1).kind != "host_oom"  # it did not fail
    assert outcome_without_report(tmp_path, 3, oom_kills=1).kind == "oom"  # the runner's own exit code names it
    # A device OOM the output shows stays a device OOM, whatever else the kernel did meanwhile.
    cuda = load(MESSAGES / "cuda_new_format.txt")[1]
    (tmp_path / "output.log").write_text(cuda)
    assert outcome_without_report(tmp_path, 1, oom_kills=1).kind == "oom"
