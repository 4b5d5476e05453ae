"""The shape every rung module fills in.

A rung module declares everything about its rung in one :class:`Rung` value: its name and
exactness, the Plan knob it turns, its pure Plan -> Plan step, what it does to the memory
model's consumers, how it shows in a plan's one-line summary, how it reaches a process
environment, how the built-in trainers apply it (model, optimizer, autocast), and what it
means for a command job. The planner, the doctor, the memory model, Plan.short, command jobs
and the built-in trainers read these declarations and never name a rung.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from oomguard.strategies.plan import Plan

# How the planner and the memory model treat a rung's knob:
# "shape"   - part of a plan's shape: the memory model fits one peak line per shape, and the
#             planner steps it to find the shapes a job can reach;
# "batch"   - the variable of that line (the micro-batch): the planner tries every value of
#             ``choices`` with every shape;
# "process" - a setting of the process only (allocator options): no part of the shape, nor of
#             the doctor's walk down the ladder; only ``cures_fragmentation`` takes it.
Role = Literal["shape", "batch", "process"]

# The consumers of an OOM's breakdown a rung can shrink (strategies/outcome.py MemoryFigures).
Consumer = Literal["activations", "gradients", "optimizer_state", "parameters", "frozen", "ema"]
# The frozen parts a text-to-image job keeps beside its UNet, as the memory model counts them.
FrozenPart = Literal["vae", "text"]

_PLAN_FIELDS = frozenset(f.name for f in dataclasses.fields(Plan))


@dataclass(frozen=True)
class MemoryTerms:
    """What a rung that is on does to the memory model's consumers, relative to a plain fp32
    AdamW plan. The neutral values change nothing, so a rung states only what it changes.

    ``activation`` and ``time`` scale one sample's activations and forward+backward time (the
    factors of all rungs that are on are multiplied, in ladder order). ``adapter_share``: only
    adapters are trained, this share of the full model's parameters, over a frozen base;
    ``base_share``: bytes kept per byte of that frozen base (only with adapters: nothing else is
    frozen). ``optimizer_bytes_per_byte``: optimizer state per byte of trained parameters;
    ``optimizer_on_device`` False: that state lives in host memory; ``ema_on_device`` False:
    so does the average of the trained weights (train.ema). ``cast_share``: extra bytes
    per parameter byte a step keeps (autocast's low-precision copies). ``frozen_dropped``: frozen
    parts no longer kept on the device between steps; ``frozen_scale``: bytes kept per byte of
    the frozen parts that stay (16-bit copies of fp32 weights: 0.5).
    """

    activation: float = 1.0
    time: float = 1.0
    adapter_share: float | None = None
    base_share: float | None = None
    optimizer_bytes_per_byte: float | None = None
    optimizer_on_device: bool = True
    ema_on_device: bool = True
    cast_share: float = 0.0
    frozen_dropped: frozenset[FrozenPart] = frozenset()
    frozen_scale: float = 1.0
    # The shares of the parameters, gradients and optimizer state one rank keeps on its device
    # under sharding (strategies/rungs/sharding.py); 1.0: a whole copy.
    parameter_share: float = 1.0
    gradient_share: float = 1.0
    optimizer_share: float = 1.0
    # The share of the model's parameters whose weights, gradients and optimizer state rest in
    # host memory between uses (strategies/rungs/layer_offload.py): an estimate, replaced by
    # the bytes a measurement's static figures name under ``state_on_host_key`` when it has them.
    state_on_host: float = 0.0
    state_on_host_key: str | None = None


@dataclass(frozen=True)
class FrozenHandling:
    """What a trainer with frozen parts (jobs/trainers/text_to_image.py) does with them under a
    plan: the effects of the frozen-part rungs, which each rung sets through its ``frozen`` hook,
    so that the trainer reads effects and never a rung's name.

    ``latents_cached``: every image is encoded once and the VAE leaves the device;
    ``text_cached``: every caption is encoded once and the text encoders leave the device;
    ``on_host``: the frozen parts live in host memory and visit the device only to encode;
    ``encode_sliced``: the VAE encodes one image at a time; ``encode_tiled``: in overlapping
    tiles (approximate); ``half``: the frozen parts' weights are 16-bit (approximate).
    """

    latents_cached: bool = False
    text_cached: bool = False
    on_host: bool = False
    encode_sliced: bool = False
    encode_tiled: bool = False
    half: bool = False


@dataclass(frozen=True)
class Placeholder:
    """A ``{name}`` a command job's argv may carry. ``listed``: where error messages and the
    README list it among every placeholder (kept as users have always seen them)."""

    name: str
    help: str
    listed: int


@dataclass(frozen=True)
class WhenKey:
    """A ``[command.when]`` key: arguments added while the rung's knob is on. ``listed`` as for
    :class:`Placeholder`."""

    key: str
    help: str
    listed: int


def _no_values(plan: Plan) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class CommandSide:
    """What the rung means for a command job (a user's script).

    ``needs``: what the command must pass on for the rung to be taken, each an alternative of
    ``{placeholder}`` or ``when:KEY`` separated by ``|``; a rung with no needs (the allocator:
    an environment variable the daemon sets) is every script's. ``values``: the rung's
    placeholders' values under a plan.
    """

    placeholders: tuple[Placeholder, ...] = ()
    when: WhenKey | None = None
    needs: tuple[str, ...] = ()
    values: Callable[[Plan], dict[str, str]] = _no_values


# Builds an optimizer over the given tensors (fused: use torch's fused kernel, None: its choice).
MakeOptimizer = Callable[[list[Any], bool | None], Any]


def _no_environment(plan: Plan, env: Mapping[str, str]) -> dict[str, str]:
    return dict(env)


def _no_model_change(plan: Plan, model: Any) -> None:
    return None


def _no_adaptation(plan: Plan, model: Any, seed: int) -> bool:
    return False


def _no_optimizer(plan: Plan, params: list[Any], lr: float, weight_decay: float, fused: bool | None) -> Any:
    return None


def _not_placed(plan: Plan, params: list[Any], make: MakeOptimizer, memory: Any) -> Any:
    return None


def _no_autocast(plan: Plan, device: Any) -> Any:
    return None


def _frozen_unchanged(plan: Plan, handling: FrozenHandling) -> FrozenHandling:
    return handling


def _ema_beside_weights(plan: Plan) -> bool:
    return False


def _no_memory_terms(plan: Plan) -> MemoryTerms | None:
    return None


def _no_label(plan: Plan) -> str | None:
    return None


def no_conflict(plan: Plan) -> str | None:
    return None


def _saved_on_device(plan: Plan, memory: Any, model: Any) -> Any:
    return None


def not_sharded(plan: Plan, model: Any, mesh: Any) -> str | None:
    return None


def all_on_device(plan: Plan, model: Any, device: Any, memory: Any) -> bool:
    return False


@dataclass(frozen=True)
class Rung:
    """One memory saving of the ladder.

    ``step`` returns the plan with this rung taken one notch further, or None when this rung
    has nothing more to give (e.g. micro-batch already 1). ``describe`` says in words what a
    step changed, for events and notifications. ``knob`` is the Plan field the rung turns, or
    a name kept in ``Plan.extra`` for a knob Plan has no field for; ``default`` is its value
    when the rung is not taken (for the batch rung: the value its memory line starts from).
    """

    name: str
    exact: bool
    # True when the change only takes effect in a new process (allocator settings are read
    # once, when CUDA initialises).
    needs_restart: bool
    step: Callable[[Plan], Plan | None]
    describe: Callable[[Plan, Plan], str]
    knob: str
    default: Any
    role: Role = "shape"
    # The consumers it shrinks: the doctor tries these rungs first when one dominated an OOM.
    shrinks: frozenset[Consumer] = frozenset()
    # It shrinks only activations: no help when the OOM came before any existed (setup).
    activations_only: bool = False
    # The doctor's answer to a fragmented caching allocator.
    cures_fragmentation: bool = False
    # When the knob counts as on (memory terms, [command.when]); None: when it is not ``default``.
    on: Callable[[Plan], bool] | None = None
    memory: Callable[[Plan], MemoryTerms | None] = _no_memory_terms
    # Its part of Plan.short, None when it has nothing to say for the plan.
    label: Callable[[Plan], str | None] = _no_label
    # The values the planner tries for a batch rung, from the job's first plan.
    choices: Callable[[Plan], Iterable[Any]] | None = None
    environment: Callable[[Plan, Mapping[str, str]], dict[str, str]] = _no_environment
    # -- how the built-in trainers apply it (jobs/training.py, jobs/optimizers.py). The hooks
    # import torch and the code under jobs/ inside themselves: strategies/ loads without torch.
    # Applied to a built model, on the device, and again whenever the plan changes in process.
    configure_model: Callable[[Plan, Any], None] = _no_model_change
    # Changes a freshly built model on the host, before it moves to the device (what is trained,
    # how frozen weights are stored), drawing anything random from ``seed``. True when it froze
    # the model's own weights: checkpoints then keep those apart, as the base.
    adapt_model: Callable[[Plan, Any, int], bool] = _no_adaptation
    # The optimizer over ``params`` (lr, weight_decay, fused), or None: the next rung's, and
    # torch's AdamW when no rung has one.
    make_optimizer: Callable[[Plan, list[Any], float, float, bool | None], Any] = _no_optimizer
    # An optimizer that keeps its state away from the parameters' device, built over copies of
    # ``params`` with ``make``, or None: the optimizer sits beside its parameters.
    place_optimizer: Callable[[Plan, list[Any], MakeOptimizer, Any], Any] = _not_placed
    # The torch dtype forward and backward run in under autocast on ``device``, or None.
    autocast_dtype: Callable[[Plan, Any], Any] = _no_autocast
    # Where forward keeps what backward needs: a context manager (autograd's saved-tensor hooks)
    # the forward of ``model`` runs under, moving it through the run's DeviceMemory, or None: on
    # the device, as autograd keeps it.
    saved_activations: Callable[[Plan, Any, Any], Any] = _saved_on_device
    # What it does to the frozen parts of a trainer that has some (FrozenHandling).
    frozen: Callable[[Plan, FrozenHandling], FrozenHandling] = _frozen_unchanged
    # True: the average of the trained weights (train.ema) lives and is updated in host memory.
    ema_on_host: Callable[[Plan], bool] = _ema_beside_weights
    # Shards a built model (on the host) across a device mesh (FSDP2) when the plan asks, and
    # says where the shards live: "device" or "host"; None: not sharded.
    shard_model: Callable[[Plan, Any, Any], str | None] = not_sharded
    # Moves a built model (on the host) of a single process to ``device``, keeping part of its
    # weights in host memory, streamed to the device as they are used (the run's DeviceMemory
    # counts what arrives); True when it did, False: the runner moves the whole model.
    keep_on_host: Callable[[Plan, Any, Any, Any], bool] = all_on_device
    # Why a plan with this rung on cannot run with the rest of the plan (None: it can). The
    # planner never offers such a plan; the runner refuses one.
    conflict: Callable[[Plan], str | None] = no_conflict
    # None: a command job never takes it.
    command: CommandSide | None = None
    # Taken only once every chained rung before it on the ladder (of those allowed) is taken:
    # the frozen-part rungs are tried as one cumulative chain, not in every combination (six
    # rungs would multiply the planner's candidates by 64; most combinations repeat each other,
    # as nothing is left to offload once both encodings are cached).
    chained: bool = False
    # What a job must offer for the rung to apply (JobSpec.features): "full_model" (the job
    # trains the whole model, so LoRA and a quantized base are a change it can make),
    # "frozen_parts" (the job has frozen encoders on the device: VAE, text encoders),
    # "fixed_crops" (each image always becomes the same sample, up to a flip: its latents can
    # be computed once), "ema" (the job keeps an average of its trained weights). Empty: every
    # job.
    needs: frozenset[str] = frozenset()

    def get(self, plan: Plan) -> Any:
        if self.knob in _PLAN_FIELDS:
            return getattr(plan, self.knob)
        return plan.extra_value(self.knob, self.default)

    def set(self, plan: Plan, value: Any) -> Plan:
        if self.knob in _PLAN_FIELDS:
            return plan.replace(**{self.knob: value})
        return plan.with_extra(self.knob, value, self.default)

    def is_on(self, plan: Plan) -> bool:
        return self.on(plan) if self.on is not None else self.get(plan) != self.default
