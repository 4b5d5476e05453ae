"""Emulated GPUs: the files that stand in for the driver's view, and the GPU sources."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.daemon.gpus import EmulatedGpus, NvmlGpus, open_gpus
from oomguard.daemon.monitor import GpuMonitor
from oomguard.daemon.store import Store
from oomguard.jobs.emulated_gpus import AssignedGpu, EmulatedGpu, EmulatedGpuFolder, parse_gpus
from oomguard.strategies.errors import NoGpus

MiB = 2**20


@pytest.mark.parametrize(
    ("text", "sizes"),
    [("2x64MiB", [64 * MiB, 64 * MiB]), ("1 x 24GiB", [24 * 2**30]), ("64MiB,48MiB", [64 * MiB, 48 * MiB])],
)
def test_parse_gpus(text, sizes):
    assert [g.total for g in parse_gpus(text)] == sizes
    assert [g.index for g in parse_gpus(text)] == list(range(len(sizes)))


@pytest.mark.parametrize(("text", "problem"), [("2x", "not an emulated GPU list"), ("0x64MiB", "between 1 and 64"), ("lots", "not an emulated GPU list")])
def test_bad_gpu_lists_say_what_is_expected(text, problem):
    with pytest.raises(ValueError, match=problem) as caught:
        parse_gpus(text)
    assert "e.g. 2x64MiB" in str(caught.value)


@pytest.fixture
def sleeper():
    """A live process other than this one, to hold memory on an emulated GPU."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_processes_add_up_and_the_dead_are_ignored_then_pruned(tmp_path: Path, sleeper):
    folder = EmulatedGpuFolder(tmp_path).create((EmulatedGpu(0, 64 * MiB), EmulatedGpu(1, 32 * MiB)))
    folder.publish(0, os.getpid(), 10 * MiB, "runner")
    folder.publish(0, sleeper.pid, 20 * MiB, "neighbour")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    folder.publish(0, int(dead), 30 * MiB, "gone")
    assert sorted(p.used_bytes for p in folder.processes(0)) == [10 * MiB, 20 * MiB]
    assert folder.used_by_others(0, os.getpid()) == 20 * MiB
    assert AssignedGpu(folder, 0).capacity_for(os.getpid()) == 44 * MiB
    assert (tmp_path / "0" / f"{dead}.json").exists()
    folder.processes(0, prune=True)
    assert not (tmp_path / "0" / f"{dead}.json").exists()
    folder.withdraw(0, sleeper.pid)
    assert folder.used_by_others(0, os.getpid()) == 0


def test_the_runner_finds_its_gpu_in_its_environment(tmp_path: Path):
    EmulatedGpuFolder(tmp_path).create(parse_gpus("2x64MiB"))
    assigned = AssignedGpu.from_environment({"OOMGUARD_EMULATED_GPUS": str(tmp_path), "CUDA_VISIBLE_DEVICES": "1"})
    assert assigned is not None and assigned.index == 1 and assigned.capacity_for(os.getpid()) == 64 * MiB
    assert AssignedGpu.from_environment({"CUDA_VISIBLE_DEVICES": "1"}) is None


def test_emulated_gpus_read_like_nvml(tmp_path: Path, sleeper):
    source = open_gpus("2x64MiB", tmp_path / "gpus")
    assert isinstance(source, EmulatedGpus) and source.emulated_root == tmp_path / "gpus"
    source.folder.publish(1, sleeper.pid, 40 * MiB, "neighbour")
    zero, one = source.read()
    assert (zero.used, zero.free, zero.processes) == (0, 64 * MiB, ())
    assert (one.used, one.free, [p.pid for p in one.processes]) == (40 * MiB, 24 * MiB, [sleeper.pid])


def test_without_nvidia_gpus_nvml_says_so_and_what_to_do(tmp_path: Path):
    try:
        NvmlGpus()
    except NoGpus:
        pass
    else:  # pragma: no cover - a machine with a GPU
        pytest.skip("this machine has an NVIDIA GPU")
    with pytest.raises(NoGpus, match=r"no NVIDIA GPU found .*--emulate-gpus 2x24GiB"):
        open_gpus(None, tmp_path)


def test_the_monitor_samples_into_the_store_and_stays_bounded(tmp_path: Path, sleeper):
    store = Store(tmp_path / "db.sqlite")
    source = EmulatedGpus(tmp_path / "gpus", "2x64MiB")
    source.folder.publish(0, sleeper.pid, 8 * MiB, "neighbour")
    monitor = GpuMonitor(source, store, every_seconds=0.0, keep_per_gpu=20)
    for _ in range(100):
        monitor.tick()
    for index in (0, 1):
        kept = store.gpu_samples(index)
        assert 10 <= len(kept) <= 20
        times = [row.at for row in kept]
        assert times == sorted(times)
    latest = store.latest_gpu_samples()
    assert [(row.gpu, row.used, row.name) for row in latest] == [(0, 8 * MiB, "emulated 64.00 MiB"), (1, 0, "emulated 64.00 MiB")]
