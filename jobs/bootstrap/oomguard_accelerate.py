"""What accelerate restores on resume, corrected for a relaunch with another split.

oomguard relaunches a script after an OOM with a smaller micro-batch and more gradient
accumulation (the same effective batch). The script resumes from its ``checkpoint-N`` with
``accelerator.load_state``, and two things it gets back are counted in the old split:

- accelerate's own micro-step counter (``Accelerator.step``, saved in random_states_0.pkl, and
  only by rank 0: other ranks keep 0). It decides when gradients are synchronised
  (``step % gradient_accumulation_steps == 0``): restored as 5 micro-steps of an
  accumulation of 1 and read with an accumulation of 2, the first optimizer step after resume
  takes one micro-batch instead of two, every later one is shifted, and the run ends a step
  late. It is set to the optimizer steps done in the epoch times the new accumulation, on
  every rank.
- the learning-rate schedule. Scripts size it from their data loader, whose length is counted
  in micro-batches (diffusers' train_unconditional.py: ``num_training_steps=len(loader) *
  num_epochs``, warm-up times the accumulation), so the relaunched script builds a longer
  schedule, and the job would end at another learning rate. diffusers' ``get_scheduler``
  builds the schedule of the job's first attempt instead: the arguments of every call are kept
  in the attempt folder (schedules.json), and the daemon hands the first attempt's to the
  later ones (``first_schedules`` in OOMGUARD_ATTEMPT), whether or not it left a checkpoint.

Each ``save_state`` also writes ``oomguard.json`` beside accelerate's files: the job's
optimizer step, the split and accelerate's counter. A checkpoint without it (written before
oomguard ran the job) is read by its name only.

Loaded into the user's own interpreter: standard library only until the script imports
accelerate or diffusers.
"""

import functools
import inspect
import json
import os
import re
import sys
import weakref

import oomguard_imports
import oomguard_progress
import oomguard_time_limit
from oomguard_imports import guarded

SIDECAR = "oomguard.json"

# diffusers' get_scheduler (the wrapper's target), and the arguments each schedule was built
# with: LambdaLR -> {"name", "num_warmup_steps", "num_training_steps", ...}.
_GET_SCHEDULER = []
_BUILT_WITH = weakref.WeakKeyDictionary()
_CALLS = []  # the arguments of every get_scheduler call of this process, as built, in order
SCHEDULES = "schedules.json"
# The Accelerator the script made (the last one), for the expected final learning rate.
_ACCELERATOR = []


def _say(text):
    print("oomguard: " + text, file=sys.stderr, flush=True)


# -- diffusers' get_scheduler -------------------------------------------------------------


@guarded("wrapping diffusers' get_scheduler")
def _wrap_get_scheduler(module):
    original = module.get_scheduler
    _GET_SCHEDULER.append(original)
    signature = inspect.signature(original)

    @guarded("reading the learning-rate schedule's arguments")
    def arguments_of(args, kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = {k: v for k, v in bound.arguments.items() if k not in ("optimizer", "last_epoch")}
        arguments["name"] = str(getattr(arguments["name"], "value", arguments["name"]))
        json.dumps(arguments)  # arguments that cannot be kept: the schedule is not visible
        return arguments, bound.arguments["optimizer"], bound.arguments.get("last_epoch", -1)

    @functools.wraps(original)
    def get_scheduler(*args, **kwargs):
        read = arguments_of(args, kwargs)
        if read is None:
            return original(*args, **kwargs)
        arguments, optimizer, last_epoch = read
        first = _first_schedule(len(_CALLS))
        scheduler = None
        if first is not None and first != arguments:
            try:
                scheduler = original(optimizer=optimizer, last_epoch=last_epoch, **first)
            except (TypeError, ValueError) as error:
                _say("cannot build the job's first learning-rate schedule {} ({}); kept the script's".format(_describe(first), error))
            else:
                _say(
                    "the script sized its learning-rate schedule as {} for this split; built the job's first schedule {} "
                    "instead (the split changes no optimizer step)".format(_describe(arguments), _describe(first))
                )
                arguments = first
        if scheduler is None:
            scheduler = original(*args, **kwargs)
        _BUILT_WITH[scheduler] = arguments
        _CALLS.append(arguments)
        _keep_schedules()
        return scheduler

    module.get_scheduler = get_scheduler


def _first_schedule(index):
    """The arguments of the ``index``-th schedule of the job's first attempt (None: unknown)."""
    first = oomguard_progress.attempt().get("first_schedules")
    if isinstance(first, list) and index < len(first) and isinstance(first[index], dict):
        return first[index]
    return None


@guarded("keeping the learning-rate schedules' arguments")
def _keep_schedules():
    oomguard_progress.write_attempt_file(SCHEDULES, json.dumps(_CALLS))


def _lambda_of(arguments):
    """The learning-rate factor of the schedule ``arguments`` describe, as a function of the
    scheduler's position."""
    key = json.dumps(arguments, sort_keys=True)
    if key not in _LAMBDAS:
        import torch

        throwaway = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        _LAMBDAS[key] = _GET_SCHEDULER[0](optimizer=throwaway, **arguments).lr_lambdas[0]
    return _LAMBDAS[key]


_LAMBDAS = {}


def _inner(scheduler):
    return getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps it


@guarded("working out the learning rate the job must end at")
def _expected_final_lr():
    """The learning rate the first attempt's schedule gives at the job's last step (None: not
    visible). accelerate steps a prepared scheduler once per process per optimizer step."""
    if not _ACCELERATOR or not _GET_SCHEDULER:
        return None
    accelerator = _ACCELERATOR[-1]()
    max_steps = oomguard_progress.attempt().get("max_steps")
    if accelerator is None or not max_steps or not accelerator._schedulers:
        return None
    scheduler = accelerator._schedulers[0]
    inner = _inner(scheduler)
    arguments = _BUILT_WITH.get(inner)
    if arguments is None or not getattr(scheduler, "step_with_optimizer", True):
        return None
    per_step = 1 if getattr(scheduler, "split_batches", False) else accelerator.num_processes
    return inner.base_lrs[0] * _lambda_of(arguments)(max_steps * per_step)


# -- Accelerator ----------------------------------------------------------------------------


def _sidecar(accelerator):
    return {
        "step": oomguard_progress.current_step(),
        "accelerate_step": accelerator.step,
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "num_processes": accelerator.num_processes,
    }


def _read_sidecar(directory):
    try:
        with open(os.path.join(directory, SIDECAR)) as source:
            data = json.load(source)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _correct_counter(accelerator, saved):
    """accelerate's micro-step counter in the new split (see the module's docstring)."""
    before = saved.get("gradient_accumulation_steps")
    counter = saved.get("accelerate_step")
    if not isinstance(before, int) or not isinstance(counter, int) or before < 1:
        return
    corrected = counter // before * accelerator.gradient_accumulation_steps
    if corrected != accelerator.step:
        _say(
            "accelerate's accumulation counter came back as {} (micro-batches of the saved split, gradient "
            "accumulation {}); set to {} for gradient accumulation {}".format(
                accelerator.step, before, corrected, accelerator.gradient_accumulation_steps
            )
        )
        accelerator.step = corrected


def _describe(arguments):
    return "{}(warm-up {}, {} steps)".format(arguments.get("name"), arguments.get("num_warmup_steps"), arguments.get("num_training_steps"))


def _step_of(directory):
    """The step in a checkpoint folder's name, as diffusers' examples name them (checkpoint-N)."""
    match = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(os.path.normpath(directory)))
    return int(match.group(1)) if match else None


@guarded("writing oomguard.json beside the checkpoint")
def _write_sidecar(accelerator, location):
    temporary = os.path.join(location, ".{}.tmp".format(SIDECAR))
    with open(temporary, "w") as out:
        json.dump(_sidecar(accelerator), out)
    os.replace(temporary, os.path.join(location, SIDECAR))


@guarded("correcting what accelerate restored")
def _after_loading(accelerator, input_dir):
    saved = _read_sidecar(input_dir)
    if saved is None:
        step = _step_of(input_dir)
    else:
        step = saved.get("step")
        _correct_counter(accelerator, saved)
    if isinstance(step, int):
        oomguard_progress.resumed(step)


@guarded("patching accelerate's Accelerator")
def _patch_accelerator(module):
    accelerator_class = module.Accelerator
    original_init = accelerator_class.__init__
    original_save = accelerator_class.save_state
    original_load = accelerator_class.load_state
    original_backward = accelerator_class.backward

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _ACCELERATOR.append(weakref.ref(self))
        if oomguard_progress.expected_final_lr is None:
            oomguard_progress.expected_final_lr = _expected_final_lr

    @functools.wraps(original_save)
    def save_state(self, *args, **kwargs):
        location = original_save(self, *args, **kwargs)
        if location and self.is_main_process:
            _write_sidecar(self, location)
        return location

    @functools.wraps(original_load)
    def load_state(self, input_dir=None, *args, **kwargs):
        result = original_load(self, input_dir, *args, **kwargs)
        if input_dir is not None:  # else accelerate's automatic naming: no folder of the job's step
            _after_loading(self, input_dir)
        return result

    @functools.wraps(original_backward)
    def backward(self, loss, *args, **kwargs):
        oomguard_time_limit.before_backward(self)  # a cluster's time limit near: checkpoint and stop here
        oomguard_progress.last_loss = loss.detach()
        return original_backward(self, loss, *args, **kwargs)

    accelerator_class.__init__ = __init__
    accelerator_class.save_state = save_state
    accelerator_class.load_state = load_state
    accelerator_class.backward = backward


def install():
    oomguard_imports.when_imported("diffusers.optimization", _wrap_get_scheduler)
    oomguard_imports.when_imported("accelerate.accelerator", _patch_accelerator)
