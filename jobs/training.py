"""One plan's training objects and one optimizer step: what the training loop and the probe
both run.

Precision is handled here with torch.autocast (and a GradScaler for fp16) rather than
accelerate's Accelerator: the Accelerator's state is a process-wide singleton whose mixed
precision cannot change once set, and the probe builds several plans in one process.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from oomguard.jobs.attempt import Control
from oomguard.jobs.ema import EmaWeights
from oomguard.jobs.fused_backward import FusedBackwardOptimizer
from oomguard.jobs.layer_offload import held_bytes, held_on_host
from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.optimizers import build_optimizer, device_state_tensors
from oomguard.jobs.rank_group import RankGroup
from oomguard.jobs.spec import JobSpec
from oomguard.jobs.trainers.base import Trainer
from oomguard.strategies import rungs
from oomguard.strategies.static_bytes import EMA_SIZE, FROZEN_SIZE_PREFIX, WHOLE_MODEL_BYTES
from oomguard.strategies.plan import Plan


@dataclass(frozen=True)
class ModelWeights:
    """Weights to start from, on the host: the whole model's (``base``, the model's own keys),
    for a LoRA run the adapters' of rank ``lora_rank``, and the average of the trained weights
    (``ema``, by the final model's names) of a job with train.ema."""

    base: dict[str, torch.Tensor]
    adapters: dict[str, torch.Tensor] | None = None
    lora_rank: int | None = None
    ema: dict[str, torch.Tensor] | None = None


@dataclass
class Training:
    """Model, optimizer and schedule under one plan. ``plan`` changes in place when the
    runner takes a rung that needs no new process."""

    plan: Plan
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    scaler: torch.amp.GradScaler | None
    autocast_dtype: torch.dtype | None
    device: torch.device
    # The frozen base weights of a LoRA run, on the host (checkpoints write them; the device
    # may hold them quantized).
    base_state: dict[str, torch.Tensor] | None = None
    # The trainer's frozen parts on the device now (Trainer.frozen_tensors), and the bytes of
    # each in full precision wherever it is (Trainer.frozen_sizes).
    frozen: Callable[[], list[torch.Tensor]] = list
    frozen_sizes: Callable[[], dict[str, int]] = dict
    # The average of the trained weights (train.ema), updated after every optimizer step.
    ema: EmaWeights | None = None
    # The ranks this training is one of (a group of one for a single process), and where a
    # sharded model keeps its shards: None (not sharded), "device" or "host".
    ranks: RankGroup = field(default_factory=RankGroup)
    shards: str | None = None

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def on_device(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """What of ``tensors`` this rank holds on its device: a sharded model's shards as it
        holds them (``local``); an unsharded model's blocks held on the host (layer offload) left out."""
        if self.shards is not None:
            return local(tensors)
        return [t for t in tensors if not held_on_host(t)]

    def device_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The consumers of device memory, for the OOM breakdown."""
        return {
            "parameters": self.on_device(self.model.parameters()),
            "gradients": self.on_device(p.grad for p in self.model.parameters() if p.grad is not None),
            "optimizer_state": self.on_device(device_state_tensors(self.optimizer)),
            "frozen": self.frozen(),
            "ema": self.ema.device_tensors() if self.ema is not None else [],
        }

    def static_bytes(self) -> dict[str, int]:
        """Bytes of parameters, trainable parameters, optimizer state, frozen parts and the EMA
        on the device (the memory model's static consumers), and the sizes of the frozen parts
        and the EMA wherever they are."""

        def total(tensors: list[torch.Tensor]) -> int:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            return sum(storages.values())

        # A sharded model's parameters are DTensors: their numel is the whole tensor's (the
        # trained share is of the whole model).
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        parameters = self.on_device(self.model.parameters())
        partial = self.shards is not None or len(parameters) < len(list(self.model.parameters()))
        whole = {WHOLE_MODEL_BYTES: sum(p.numel() * p.element_size() for p in self.model.parameters())} if partial else {}
        return {
            **whole,
            # What each grade of layer offload would keep on the host (strategies/rungs/layer_offload.py).
            **(held_bytes(self.model) if self.shards is None else {}),
            "parameters": total(parameters),
            "trainable": sum(p.numel() * p.element_size() for p in trainable),
            "optimizer_state": total(self.on_device(device_state_tensors(self.optimizer))),
            "frozen": total(self.frozen()),
            **{f"{FROZEN_SIZE_PREFIX}{part}": size for part, size in self.frozen_sizes().items()},
            **({"ema": total(self.ema.device_tensors()), EMA_SIZE: self.ema.nbytes()} if self.ema is not None else {}),
        }

    def resident_bytes(self) -> int:
        """What should stay on the device between steps: parameters, buffers, the optimizer's
        device state, the frozen parts and the EMA (gradients are dropped after every step)."""
        tensors = self.on_device([*self.model.parameters(), *self.model.buffers(), *device_state_tensors(self.optimizer), *self.frozen()])
        if self.ema is not None:
            tensors += self.ema.device_tensors()
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    def weights(self) -> ModelWeights:
        """What a checkpoint keeps of the model."""
        from oomguard.jobs.adapters import adapter_state_dict

        ema = self.ema.state_dict() if self.ema is not None else None
        if self.base_state is None:
            return ModelWeights(base=trained_state(self.model), ema=ema)
        return ModelWeights(base=self.base_state, adapters=adapter_state_dict(self.model), lora_rank=self.plan.lora_rank, ema=ema)

    def trained_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The job's trained weights, by the final model's names, as the model computes with
        them now, on the device: the trainable parameters; under a rung that froze the model's
        own weights (lora, base_quantization), every weight with the adapters merged in."""
        from oomguard.jobs.adapters import merged_tensors

        if self.base_state is None:
            return ((name, p.detach()) for name, p in self.model.named_parameters() if p.requires_grad)
        return merged_tensors(self.model, buffers=False)

    def final_model(self) -> torch.nn.Module:
        """The model to save_pretrained: a LoRA run's adapters merged into its base; with
        train.ema, the averaged weights (as diffusers' scripts save them)."""
        from oomguard.jobs.adapters import merged_model

        model = merged_model(self.model) if self.base_state is not None else self.model
        if self.ema is not None:
            self.ema.copy_to(model)
        return model

    def apply(self, plan: Plan) -> None:
        """Switch to ``plan``, which differs only in knobs a running process can change."""
        rungs.configure_model(plan, self.model)
        self.plan = plan


def local(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors this rank holds: a sharded tensor's (DTensor's) own shard, others as they are."""
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def build_training(
    trainer: Trainer, job: JobSpec, plan: Plan, device: torch.device, memory: DeviceMemory, weights: ModelWeights | None = None,
    ranks: RankGroup | None = None,
) -> Training:
    """The model (the trainer seeds it: same initial weights every time, unless ``weights``
    are given), adapted and quantized as ``plan`` says, and its optimizer.

    The model is put together on the host and then moved, so a full-precision base that the
    plan quantizes never occupies the device. A plan's sharding rung shards it across the
    ranks as it moves (each rank builds the same whole model and keeps its shard).
    """
    ranks = ranks if ranks is not None else RankGroup()
    from diffusers.optimization import get_scheduler

    from oomguard.jobs.adapters import load_adapter_state_dict

    base_state = None
    with memory.paused():
        model = trainer.build_model()
        if weights is not None:
            if weights.adapters is not None and weights.lora_rank != plan.lora_rank:
                weights = _merge_adapters(trainer, weights)
            load_trained_state(model, weights.base)
        own_weights = {name: tensor.detach() for name, tensor in model.state_dict().items()}
        if rungs.adapt_model(plan, model, job.train.seed):
            # Only adapters train: checkpoints keep the frozen base apart, as it was built.
            base_state = own_weights
        del own_weights
        if weights is not None and weights.adapters is not None:
            # Adapters of this plan's rank (others were merged into the base above).
            load_adapter_state_dict(model, weights.adapters)
    trainer.place_frozen(plan, device, memory)
    shards = None
    if ranks.solo:
        # A rung may keep part of the model in host memory and move the rest itself.
        if not rungs.keep_on_host(plan, model, device, memory):
            model = model.to(device)
    else:
        with memory.paused():
            model = model.to(device) if (shards := rungs.shard_model(plan, model, ranks.mesh(device))) is None else model
    if shards != "host":
        memory.move_in(local(p for p in model.parameters() if shards is not None or not held_on_host(p)))
    rungs.configure_model(plan, model)
    optimizer = build_optimizer(plan, model, job.train.learning_rate, job.train.weight_decay, memory)
    if isinstance(optimizer, FusedBackwardOptimizer):
        # It steps inside backward, before one_step would zero these gradients.
        optimizer.zero_first(trainer.zero_gradient_parameters(model))
    lr_scheduler = get_scheduler(
        job.train.lr_scheduler, optimizer=optimizer, num_warmup_steps=job.train.lr_warmup_steps, num_training_steps=job.train.max_steps
    )
    autocast_dtype = rungs.autocast_dtype(plan, device)
    # fp16 overflows where fp32 and bf16 do not: its gradients need a scaler.
    scaler = torch.amp.GradScaler(device.type) if autocast_dtype == torch.float16 else None
    training = Training(
        plan, model, optimizer, lr_scheduler, scaler, autocast_dtype, device, base_state, trainer.frozen_tensors, trainer.frozen_sizes,
        ranks=ranks, shards=shards,
    )
    if job.train.ema:
        training.ema = _start_ema(training, job.train.ema_decay, memory, weights.ema if weights is not None else None)
    return training


def _start_ema(training: Training, largest_decay: float, memory: DeviceMemory, saved: dict[str, torch.Tensor] | None) -> EmaWeights:
    """The average where the plan keeps it: from a checkpoint's, or (fresh, or a checkpoint
    written before the job averaged these weights) from the weights themselves."""
    with memory.paused():
        current = {name: weight.to("cpu", copy=True) for name, weight in training.trained_weights()}
    start = saved if saved is not None and saved.keys() == current.keys() else current
    return EmaWeights(start, largest_decay, training.device, rungs.ema_on_host(training.plan), memory)


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without the weights the job froze (a text-to-image LoRA job's
    UNet: the trainer builds it from the pipeline folder every time, so a checkpoint holds only
    the adapters, not a copy of the whole UNet)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    return {name: value for name, value in model.state_dict().items() if name not in frozen}


def load_trained_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``trained_state``'s output into a freshly built model, whose frozen weights are the
    ones the state left out."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    result = model.load_state_dict(state, strict=False)
    missing = [name for name in result.missing_keys if name not in frozen]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the checkpoint does not match the model: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]} "
            "(was the job's model changed under its workdir? submit it with a new workdir)"
        )


def _merge_adapters(trainer: Trainer, weights: ModelWeights) -> ModelWeights:
    """A LoRA checkpoint read by a plan with another rank (or none): merge its adapters into
    its base, and go on from the merged weights."""
    from oomguard.jobs.adapters import apply_lora, load_adapter_state_dict, merged_state_dict

    model = trainer.build_model()
    model.load_state_dict(weights.base)
    apply_lora(model, weights.lora_rank)
    load_adapter_state_dict(model, weights.adapters)
    return ModelWeights(base=merged_state_dict(model), ema=weights.ema)


@dataclass(frozen=True)
class StepResult:
    loss: float
    seconds: float


def one_step(
    trainer: Trainer, training: Training, step: int, memory: DeviceMemory, control: Control, micro_batch: int | None = None
) -> StepResult:
    """One optimizer step over the whole effective batch, in micro-batches (the plan's, or
    ``micro_batch``): this rank's share of it (all of it for a single process), the gradients
    averaged over the ranks."""
    plan, model, ranks = training.plan, training.model, training.ranks
    started = time.perf_counter()
    control.phase = "data"
    with memory.paused():
        inputs = trainer.step_inputs(step)
    model.train()
    total = 0.0
    # This rank's share: samples rank * share .. (rank + 1) * share - 1 of the step's batch.
    start = ranks.rank * plan.per_rank_batch
    for size in plan.micro_batch_sizes(micro_batch):
        control.phase = "forward"
        with training.autocast(), rungs.saved_activations(plan, memory, model):
            loss = trainer.slice_loss(model, inputs, start, start + size, training.device)
        # Weight by the slice's share of this rank's samples: the sum of the slices' gradients
        # is then the gradient of the rank's mean loss, however its share was split, and their
        # average over the ranks (equal shares) that of the whole batch's mean loss.
        weighted = loss * (size / plan.per_rank_batch)
        # With the optimizer step inside backward, an OOM there may leave some weights updated and
        # others not: it is an OOM in the optimizer (no emergency checkpoint, no retry in process).
        control.phase = "optimizer" if isinstance(training.optimizer, FusedBackwardOptimizer) else "backward"
        if training.scaler is not None:
            training.scaler.scale(weighted).backward()
        else:
            weighted.backward()
        total += weighted.item()
        start += size
    if training.shards is None:
        # Unsharded: the ranks meet here, and learn of an OOM in any rank's forward or
        # backward, before they average (a sharded model averaged inside backward).
        ranks.check_in()
        control.phase = "optimizer"
        ranks.average_gradients(model.parameters())
    for parameter in trainer.zero_gradient_parameters(model):
        if parameter.grad is not None:
            parameter.grad.zero_()
    control.phase = "optimizer"
    # Shards kept on the host are updated there, outside the device's count.
    with memory.paused() if training.shards == "host" else nullcontext():
        if training.scaler is not None:
            training.scaler.step(training.optimizer)
            training.scaler.update()
        else:
            training.optimizer.step()
    training.lr_scheduler.step()
    training.optimizer.zero_grad(set_to_none=True)
    if training.ema is not None:
        # After the gradients are gone, as in diffusers' scripts; ``step`` counts from 0.
        training.ema.update(training.trained_weights(), step + 1)
    if training.device.type == "cuda":
        torch.cuda.synchronize(training.device)
    # The whole batch's loss, the same on every rank (so they agree on a divergence).
    return StepResult(loss=ranks.step_end(total), seconds=time.perf_counter() - started)
