"""`oomguard diagnose` as a user runs it, on the real messages of tests/oom_messages/ (what it
reads them as is tested in-process by tests/unit/test_oom_text.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from tests.unit.test_oom_text import MESSAGES, load


def oomguard(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "oomguard"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "oomguard.daemon.cli"]
    return subprocess.run([*command, *args], input=stdin, capture_output=True, text=True, timeout=60)


def log_file(tmp_path: Path, fixture: str) -> Path:
    path = tmp_path / f"{fixture}.log"
    path.write_text(load(MESSAGES / f"{fixture}.txt")[1])
    return path


def test_diagnose_prints_the_verdict_sizes_line_and_action(tmp_path: Path) -> None:
    result = oomguard("diagnose", str(log_file(tmp_path, "cuda_new_format_fragmentation")))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("verdict: out of device memory: fragmentation (cuda:0)")
    assert "reserved but unallocated" in out and "194.87 MiB" in out and "23.65 GiB" in out
    assert "error: torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB." in out
    assert "allocator rung" in out and "expandable_segments" in out


@pytest.mark.parametrize(
    ("fixture", "words"),
    [
        ("cuda_new_format_other_process", "waits for the other processes' memory"),
        ("cuda_old_format", "cheapest allowed rung of the ladder"),
        ("host_kernel_oom_killer", "host RAM ran out, not the GPU"),
        ("illegal_memory_access", "not an out-of-memory error"),
    ],
)
def test_diagnose_says_what_oomguard_does(tmp_path: Path, fixture: str, words: str) -> None:
    result = oomguard("diagnose", str(log_file(tmp_path, fixture)))
    assert result.returncode == 0 and words in result.stdout


def test_diagnose_quotes_an_ordinary_error(tmp_path: Path) -> None:
    result = oomguard("diagnose", str(log_file(tmp_path, "python_traceback_torchrun_prefix")))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("verdict: not an out-of-memory error")
    assert "FileNotFoundError" in result.stdout.splitlines()[1]  # why: names the exception
    assert "error: FileNotFoundError: [Errno 2] No such file or directory: '/data/captions.jsonl'" in result.stdout


def test_diagnose_json(tmp_path: Path) -> None:
    result = oomguard("diagnose", str(log_file(tmp_path, "cuda_new_format_other_process")), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kind"] == "oom_other_process"
    assert data["requested"] == 750 * 2**20
    assert data["other_processes"] == {"2493055": round(Decimal("12.02") * 2**30)}
    assert data["reserved"] == data["allocated"] + data["reserved_unallocated"]


def test_diagnose_reads_standard_input() -> None:
    result = oomguard("diagnose", "-", "--json", stdin="RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`\n")
    assert result.returncode == 0 and json.loads(result.stdout)["kind"] == "oom"


def test_diagnose_refuses_a_missing_file_with_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope.log"
    result = oomguard("diagnose", str(missing))
    assert result.returncode == 2
    assert str(missing) in result.stderr and "no such file" in result.stderr and "- to read standard input" in result.stderr
    result = oomguard("diagnose", str(tmp_path))
    assert result.returncode == 2 and "is a directory" in result.stderr
