# oomguard — `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv when it is missing and install what they need into it.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch is used where no NVIDIA GPU answers nvidia-smi. Override on a
# machine whose package index lacks it, e.g.
#   make TORCH_CPU="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch
STAMP := $(VENV)/.oomguard-installed

.PHONY: demo test test-fast slurm-tools browser-tools bench faults soak install clean

install: $(STAMP)

# Re-install when pyproject.toml changes; torch is installed only when the venv has none,
# so a torch the user put there (e.g. a CUDA build) is left alone.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
	    echo "keeping installed torch $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	elif nvidia-smi -L >/dev/null 2>&1; then \
	    echo "NVIDIA GPU found: installing $(TORCH_GPU)"; $(BIN)/pip install -q $(TORCH_GPU); \
	else \
	    echo "no NVIDIA GPU found: installing the CPU build ($(TORCH_CPU))"; $(BIN)/pip install -q $(TORCH_CPU); \
	fi
	$(BIN)/pip install -q -e '.[test]'
	@touch $(STAMP)

# The quickstart job on an emulated device of 200 MiB that shrinks to 100 MiB at step 15 (as
# if another process took the rest): the full batch (about 148 MiB) no longer fits there.
DEMO_CAP ?= 200MiB,100MiB@15
demo: $(STAMP)
	rm -rf demo-workdir
	$(BIN)/oomguard run jobs/examples/quickstart.toml --workdir demo-workdir --emulate-device-memory $(DEMO_CAP)
	@echo "the attempt's log: $(BIN)/oomguard --state-dir demo-workdir/.oomguard logs 1"
	@echo "the job's record:  $(BIN)/oomguard --state-dir demo-workdir/.oomguard show 1"

# The whole suite but the benchmark smoke runs (marker `bench`) and the long variants (marker
# `long`, run by `make faults`), in TEST_WORKERS processes: on 2
# cores a third worker keeps them busy while another waits on a daemon, a poll or a sleep. A
# file's tests stay in one worker (they share module fixtures: a daemon, a corpus). One torch
# thread per process: workers' runners with a thread per core each fought over the cores.
TEST_WORKERS ?= 3
test: $(STAMP) slurm-tools browser-tools
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not bench and not long" -n $(TEST_WORKERS) --dist loadfile

# The Slurm backend's end-to-end tests start a throwaway cluster (tests/slurm_cluster.py) with
# Debian's slurm-wlm and munge: installed here when missing and make runs as root (about 20 s).
# Otherwise, or when apt-get fails, a line says so and those tests skip with the reason. apt may
# start a system munged (on /run/munge); the tests' clusters use their own socket, ports and key.
SLURM_TOOLS := sbatch squeue scontrol scancel sinfo slurmctld slurmd munged mungekey
slurm-tools:
	@missing=$$(for t in $(SLURM_TOOLS); do PATH="$$PATH:/usr/sbin:/sbin" command -v $$t >/dev/null || echo $$t; done); \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" != 0 ]; then \
	    echo "Slurm tests will skip: missing" $$missing "(as root, make installs slurm-wlm and munge)"; \
	elif ! command -v apt-get >/dev/null; then \
	    echo "Slurm tests will skip: missing" $$missing "and no apt-get to install slurm-wlm and munge"; \
	else \
	    echo "installing slurm-wlm and munge (missing:" $$missing")"; \
	    if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; then \
	        echo "installed $$(dpkg-query -W -f '$${Package} $${Version}' slurm-wlm) and munge"; \
	    else \
	        echo "Slurm tests will skip: apt-get could not install slurm-wlm and munge"; \
	    fi; \
	fi

# The dashboard's browser test (tests/e2e/test_web_browser.py) and bench/dashboard_screenshots.py
# drive headless Chromium with Debian's chromium and chromium-driver: installed here when missing
# and make runs as root (about a minute). Otherwise, or when apt-get fails, a line says so and
# the test skips with the reason.
BROWSER_TOOLS := /usr/bin/chromium /usr/bin/chromedriver
browser-tools:
	@missing=$$(for t in $(BROWSER_TOOLS); do test -x $$t || echo $$t; done); \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" != 0 ]; then \
	    echo "the browser test will skip: missing" $$missing "(as root, make installs chromium and chromium-driver)"; \
	elif ! command -v apt-get >/dev/null; then \
	    echo "the browser test will skip: missing" $$missing "and no apt-get to install chromium and chromium-driver"; \
	else \
	    echo "installing chromium and chromium-driver (missing:" $$missing")"; \
	    if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; then \
	        echo "installed $$(dpkg-query -W -f '$${Package} $${Version}' chromium) and chromium-driver"; \
	    else \
	        echo "the browser test will skip: apt-get could not install chromium and chromium-driver"; \
	    fi; \
	fi

# The unit layer alone: no process started, no sleep (tests/unit/conftest.py refuses both).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# The benchmarks, about twenty minutes on 2 cores, results in bench/results/:
# - bench/ladder.py: oomguard and accelerate's find_executable_batch_size against the best plan
#   there is, on the jobs in bench/jobs/ under emulated caps, and command jobs on scripts like
#   diffusers' examples (bench/command_pairs.py) (ladder.md, ladder.json, ladder.png), each pair
#   under the exact emulation and the caching allocator's, and the fragmentation pairs
#   (bench/allocator_pairs.py: allocator_pairs.md);
# - bench/speed.py: recovery latency, supervisor overhead, 10,000 queued jobs (speed.md, speed.json);
# - bench/dashboard_screenshots.py: the dashboard's queue and job pages in headless Chromium
#   (dashboard-queue.png, dashboard-job.png; about 20 s; skipped, with a line, without Chromium).
bench: install browser-tools
	$(BIN)/python -m pytest -q -m bench tests/integration/test_bench_speed.py tests/integration/test_gpu_check.py tests/integration/test_bench_allocator.py
	$(BIN)/python bench/ladder.py --update-readme
	$(BIN)/python bench/speed.py --update-readme
	$(BIN)/python bench/dashboard_screenshots.py

# Fault injection (bench/faults.py): 20 jobs per fault under a real daemon while runners and the
# daemon are SIGKILLed, checkpoints damaged, the disk filled and host memory squeezed under
# offloading runners (the last two as root only: a tmpfs, a memory cgroup), and a NaN injected
# after the precision rung. About 15 minutes on 2 cores; results in bench/results/faults.md
# and faults.json. First the long variants of the suite's tests (marker `long`: four ranks
# resuming a sharded checkpoint, SDXL LoRA resuming after an OOM, an SDXL job's samples; about
# a minute).
faults: install slurm-tools
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest -q -m long -n $(TEST_WORKERS) --dist loadfile
	$(BIN)/python -m pytest -q -m bench tests/e2e/test_faults.py
	$(BIN)/python bench/faults.py --update-readme

# The soak (bench/soak.py): an accelerated week for 30 minutes on emulated GPUs: jobs in
# batches, neighbours arriving and leaving, the daemon SIGKILLed every 4 minutes, and (as root)
# a small disk that fills and frees. Results in bench/results/soak.md and soak.json.
SOAK_MINUTES ?= 30
soak: install
	$(BIN)/python bench/soak.py --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) demo-workdir .pytest_cache
