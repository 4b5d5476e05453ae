"""Each optimizer step of a command job's script, reported to the daemon as the built-in
runner reports its own: a line of metrics.jsonl per step and heartbeat.json about once a
second, in the attempt directory (the files and fields of oomguard/jobs/attempt.py and
jobs/loop.py ``_report``), so that ``status``, ``show``, ``report``, the memory timeline and
the memory model see a script as they see the built-in trainer.

A step is counted when the script's optimizer steps (torch's global optimizer-step hook; with
several optimizers, the first one that steps). The job's step is the step the script resumed
from (oomguard_accelerate.py reads it from the checkpoint it loads) plus the steps taken in
this process. The process of rank 0 writes the files; every process counts, for the emulated
capacity schedule (``on_step``).

Loaded into the user's own interpreter: standard library only until torch is loaded.
"""

import atexit
import json
import os
import sys
import time

import oomguard_imports
from oomguard_imports import guarded
from oomguard_ranks import ATTEMPT_DIR_ENV

# What the daemon tells the script's processes about the attempt, as JSON: the plan in one line
# ("plan"), the job's optimizer steps ("max_steps") and effective batch ("batch_size"), and the
# learning-rate schedules of the job's first attempt ("first_schedules", oomguard_accelerate.py).
ATTEMPT_ENV = "OOMGUARD_ATTEMPT"
HEARTBEAT = "heartbeat.json"
METRICS = "metrics.jsonl"
HEARTBEAT_SECONDS = 1.0

# Set by the emulated device (oomguard.jobs.script_memory): peak_bytes, live_bytes, capacity,
# reset_peak(). Without it, CUDA's own counters are read where CUDA is in use.
device_memory = None
# The loss the script last passed to accelerator.backward (oomguard_accelerate.py), a tensor.
last_loss = None
# Known from the schedule the script built (oomguard_accelerate.py): the learning rate the job
# must end at, and the learning rate now, as functions of nothing (None: not visible).
expected_final_lr = None


class _State:
    def __init__(self):
        self.step = 0
        self.resumed_from = None
        self.optimizer = None  # the optimizer whose steps are counted (the first that stepped)
        self.last_step_at = None
        self.last_heartbeat = 0.0
        self.record = None
        self.listeners = []
        self.expected_final_lr = None


_STATE = _State()


def on_step(listener):
    """Call ``listener(step)`` with the job's step after every optimizer step, and when the
    script resumes from a checkpoint."""
    _STATE.listeners.append(listener)


def current_step():
    return _STATE.step


def resumed_from():
    """The job's step the script resumed from in this process (None: it started afresh)."""
    return _STATE.resumed_from


def resumed(step):
    """The script loaded the checkpoint of the job's step ``step``."""
    _STATE.step = step
    _STATE.resumed_from = step
    for listener in _STATE.listeners:
        listener(step)
    _write_heartbeat(force=True)


def attempt():
    try:
        sent = json.loads(os.environ.get(ATTEMPT_ENV) or "{}")
    except ValueError:
        return {}
    return sent if isinstance(sent, dict) else {}


def _is_rank_zero():
    return os.environ.get("RANK", "0") == "0"


def _memory(torch, optimizer):
    """(peak bytes allocated since the last step, capacity, bytes that stay on the device
    between steps, peak bytes reserved or None), then a new window. On the emulated device
    what stays is what outlived the step plus the gradients (made anew in each step's
    backward), not the outputs of the last micro-batch that the script still holds; on a GPU
    it is everything allocated now."""
    device = device_memory
    if device is not None:
        reserved = device.peak_reserved_bytes if device.caching else None
        figures = (device.peak_allocated_bytes, device.capacity, device.held_before_mark() + _gradient_bytes(optimizer), reserved)
        device.reset_peak()
        device.mark()
        return figures
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        figures = (torch.cuda.max_memory_allocated(), None, torch.cuda.memory_allocated(), torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        return figures
    return (None, None, None, None)


def _gradient_bytes(optimizer):
    storages = {}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            grad = parameter.grad
            if grad is not None and grad.layout == parameter.layout:
                storage = grad.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _learning_rate(optimizer):
    try:
        return float(optimizer.param_groups[0]["lr"])
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None


@guarded("reporting the optimizer step")
def _after_optimizer_step(torch, optimizer):
    state = _STATE
    if state.optimizer is None:
        state.optimizer = optimizer
    elif optimizer is not state.optimizer:
        return
    state.step += 1
    now = time.time()
    seconds = now - state.last_step_at if state.last_step_at is not None else None
    state.last_step_at = now
    reporting = _is_rank_zero() and os.environ.get(ATTEMPT_DIR_ENV)
    # The step's own figures, under the capacity it ran with, before a listener moves it on.
    peak, capacity, resident, reserved = _memory(torch, optimizer) if reporting else (None, None, None, None)
    for listener in state.listeners:
        listener(state.step)
    if not reporting:
        return
    sent = attempt()
    batch_size = sent.get("batch_size")
    loss = last_loss
    state.record = {
        "step": state.step,
        "max_steps": sent.get("max_steps"),
        "loss": float(loss) if loss is not None else None,
        # The first step of a process also timed its start-up: no rate from it.
        "samples_per_s": batch_size / seconds if batch_size and seconds else None,
        "samples": state.step * batch_size if batch_size else None,
        "peak_bytes": peak,
        # What the caching allocator held from the card at most (a card must hold it).
        "reserved_bytes": reserved,
        "capacity_bytes": capacity,
        # What stays on the device between steps (weights, optimizer state, gradients): the part
        # of the peak that does not grow with the micro-batch, for the memory model.
        "resident_bytes": resident,
        "lr": _learning_rate(optimizer),
        "plan": sent.get("plan"),
        "time": now,
    }
    _append(METRICS, json.dumps(state.record) + "\n")
    _write_heartbeat(force=state.step == sent.get("max_steps"))


@guarded("writing the heartbeat")
def _write_heartbeat(force=False):
    attempt_dir = os.environ.get(ATTEMPT_DIR_ENV)
    if not attempt_dir or not _is_rank_zero():
        return
    now = time.monotonic()
    if not force and now - _STATE.last_heartbeat < HEARTBEAT_SECONDS:
        return
    _STATE.last_heartbeat = now
    heartbeat = dict(_STATE.record or {"step": _STATE.step, "max_steps": attempt().get("max_steps"), "time": time.time()})
    heartbeat["resumed_from"] = _STATE.resumed_from
    heartbeat["recoveries"] = []
    if _STATE.optimizer is not None:
        heartbeat["final_lr"] = _learning_rate(_STATE.optimizer)
    if expected_final_lr is not None:
        # Kept once known: at exit the script's accelerator and schedulers may be gone.
        known = expected_final_lr()
        if known is not None:
            _STATE.expected_final_lr = known
    heartbeat["expected_final_lr"] = _STATE.expected_final_lr
    _write_atomic(HEARTBEAT, json.dumps(heartbeat))


def write_attempt_file(name, text):
    """Write ``name`` in the attempt folder (rank 0 only), whole or not at all."""
    if os.environ.get(ATTEMPT_DIR_ENV) and _is_rank_zero():
        _write_atomic(name, text)


def _append(name, text):
    try:
        with open(os.path.join(os.environ[ATTEMPT_DIR_ENV], name), "a") as out:
            out.write(text)
    except OSError as error:
        sys.stderr.write("oomguard: cannot write {}: {}\n".format(name, error))


def _write_atomic(name, text):
    final = os.path.join(os.environ[ATTEMPT_DIR_ENV], name)
    temporary = os.path.join(os.environ[ATTEMPT_DIR_ENV], ".{}.{}.tmp".format(name, os.getpid()))
    try:
        with open(temporary, "w") as out:
            out.write(text)
        os.replace(temporary, final)
    except OSError as error:
        sys.stderr.write("oomguard: cannot write {}: {}\n".format(name, error))


@guarded("hooking the optimizer steps")
def _on_torch(torch):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: _after_optimizer_step(torch, optimizer))


def _at_exit():
    # The last heartbeat holds the learning rate the script ended with (its scheduler steps
    # after the last optimizer step). Only from a process that trained: a data-loader worker
    # started with spawn runs this bootstrap too, and must not overwrite the heartbeat.
    if _STATE.optimizer is not None:
        _write_heartbeat(force=True)


def install():
    oomguard_imports.when_imported("torch", _on_torch)
    atexit.register(_at_exit)
