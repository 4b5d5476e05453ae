"""The training loop every built-in trainer runs under: resume, train under the attempt's Plan,
recover from an OOM in forward or backward inside the process, checkpoint, report, and turn
each way of ending into an Outcome.

``train`` runs the steps of an ``AttemptRun`` in order: ``start`` (probe, then build fresh or
resume from the newest usable checkpoint), ``run_steps`` (each step, with in-process recovery
from an OOM, reporting and periodic checkpoints), ``finish`` (the final model); ``ended`` gives
whichever Outcome ended it what the attempt learnt (plans, measurements, rungs taken).
On several processes each rank runs this loop; the ranks meet where they must agree (a stop,
an OOM, a checkpoint, rank 0's decisions: jobs/rank_group.py). Over 400 lines: the steps of one
attempt share its state (progress, plan records, control, the step ups, the ranks); what each
step writes is jobs/step_report.py's, what the ranks agree on jobs/rank_group.py's.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from oomguard.jobs import checkpoints, train_state
from oomguard.jobs.bucket_limits import BucketLimits
from oomguard.jobs.attempt import METRICS, AttemptConfig, Control
from oomguard.jobs.disk_guard import checkpoint_need, disk_full_outcome, final_need, room_for, unplanned_disk_full, writing_into
from oomguard.jobs.disk_space import DiskFull, is_disk_full
from oomguard.jobs.emulated_gpus import AssignedGpu
from oomguard.jobs.memory_cap import DeviceMemory, open_device_memory
from oomguard.jobs.probe import run_probe
from oomguard.jobs.rank_group import PeerOutOfMemory, RankGroup
from oomguard.jobs.sampling import Sampler
from oomguard.jobs.step_report import Progress, report_step
from oomguard.jobs.step_ups import StepUps
from oomguard.jobs.tracking import TrainingMetrics
from oomguard.jobs.trainers import make_trainer
from oomguard.jobs.trainers.base import Trainer
from oomguard.jobs.training import StepResult, Training, build_training, one_step
from oomguard.jobs.step_oom import IN_PROCESS_PHASES, RankAlone, agreed_oom, free, oom_measurement, unfit_to_continue
from oomguard.strategies.contention import find_contention
from oomguard.strategies.doctor import decide_in_process, describe_oom
from oomguard.strategies.memory_model import Measurement, MemoryModel
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.units import format_mib

# In-process rung changes per attempt, at most (each one excludes a plan, so the ladder ends
# well before; this bounds it regardless).
MAX_RECOVERIES = 32

# Called after each optimizer step with the Training and the step count, before the step is
# reported or checkpointed (jobs/run.py hooks in jobs/faults.py this way).
StepHook = Callable[[Training, int], None]


@dataclass
class PlanRecord:
    """Steady-state steps of one plan in this process (the first step after building an
    optimizer is not steady: its state appears only in that step)."""

    peaks: list[int] = field(default_factory=list)
    # The caching allocator's reserved peaks, where the device reports them.
    reserved: list[int] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    capacity: int | None = None
    static: dict[str, int] = field(default_factory=dict)


def train(config: AttemptConfig, attempt_dir: Path, control: Control, after_step: StepHook | None = None) -> Outcome:
    """Run the attempt to its end and say how it ended (an OOM is an Outcome, not an exception)."""
    run = AttemptRun(config, attempt_dir, control, after_step)
    metrics = (attempt_dir / METRICS).open("a")
    try:
        run.ranks.start(run.device)
        with run.memory:
            outcome = run.start()
            if outcome is None:
                run.trackers.attempt_started(run.progress.step, run.current_plan(), run.progress.resumed_from is not None, run.recoveries)
                outcome = run.run_steps(metrics)
            if outcome is None:
                outcome = run.finish()
            return run.ended(outcome)
    except torch.OutOfMemoryError as error:
        # Out of memory outside a training step: the model or a loaded checkpoint does not fit
        # (phase "setup"), or a plan stepped up to at a checkpoint does not. Still an OOM for
        # the doctor, not a crash to retry unchanged (or the way back from that step up).
        oom = run.oom_outcome(error)
        back = run.step_ups.after_oom(run.progress.step, run.current_plan(), describe_oom(oom))
        if back is not None:
            back["restart"] = True  # nothing of this process can go on
        return run.ended(run.replan(back) if back is not None else oom)
    except RankAlone as alone:
        run.measurements.extend(alone.measurements)
        return run.ended(alone.outcome)
    except (DiskFull, OSError) as error:
        # A full disk is not a crash: the attempt ends so that the job waits for room, and goes
        # on from its last verified checkpoint (a partial write has removed itself).
        if not isinstance(error, DiskFull) and not is_disk_full(error):
            raise
        full = error if isinstance(error, DiskFull) else unplanned_disk_full(error, attempt_dir, run.checkpoints_dir)
        run.say(f"disk full: {full}")
        ended = run.ended(disk_full_outcome(full, run.progress.step))
        # Full while keeping the steps before a replan: the job waits under the plan it goes to.
        return dataclasses.replace(ended, plan=run.replanned_to) if run.replanned_to is not None else ended
    finally:
        run.memory.withdraw()
        metrics.close()
        run.trackers.close()
        run.ranks.close()


class AttemptRun:
    """One attempt in this process: what its steps share (trainer, device memory, progress,
    the current Training, and what was measured and recovered so far)."""

    def __init__(self, config: AttemptConfig, attempt_dir: Path, control: Control, after_step: StepHook | None = None) -> None:
        self.config = config
        self.job = config.job
        self.attempt_dir = attempt_dir
        self.control = control
        self.after_step = after_step
        self.ranks = RankGroup.from_environment()
        self.device = self.ranks.device()
        self.trainer: Trainer = make_trainer(self.job, config.workdir)
        self.progress = Progress()
        self.training: Training | None = None
        # The plan until a Training exists (the probe may change it); then training.plan.
        self.plan = config.plan
        self.measurements: list[Measurement] = []
        self.records: dict[Plan, PlanRecord] = {}
        self.recoveries: list[dict[str, Any]] = []
        # The variable also covers a runner started by hand.
        spec = config.device.or_environment()
        self.memory = open_device_memory(spec, self.device, self._device_tensors, gpu=AssignedGpu.from_environment())
        self.checkpoints_dir = config.workdir / "checkpoints"
        # Samples while training (a text-to-image job's train.sample_every_steps), by one process.
        self.sampler: Sampler | None = None
        if self.job.train.sample_every_steps and self.ranks.solo:
            self.sampler = Sampler(self.job, self.trainer, config.workdir, self.say)
        elif self.job.train.sample_every_steps and self.ranks.main:
            self.say(f"train.sample_every_steps: samples are rendered by jobs of one process; none in this run of {self.ranks.world_size} processes")
        self.last_checkpoint_time = 0.0
        self.steps_in_process = 0
        self.step_ups = StepUps(config.step_up, origin=self.job.initial_plan(), in_process=config.recover_in_process)
        # The plan a replan goes on under, once recorded (jobs/step_ups.py).
        self.replanned_to: Plan | None = None
        # Aspect-ratio buckets (a step's size differs by bucket): what this process learnt of them.
        self.buckets = BucketLimits()
        # The job's experiment trackers (train.log_with), written by rank 0.
        self.trackers = TrainingMetrics.for_attempt(self.job.train.log_with, config.workdir, self.job.name, config.number, self.ranks.main, self.say)

    def say(self, text: str) -> None:
        if self.ranks.main:  # the ranks agree: one of them speaks for all
            print(text, flush=True)

    def _device_tensors(self) -> dict[str, list[torch.Tensor]]:
        # Before a Training exists (the probe, a plan being built) the frozen parts are there.
        return self.training.device_tensors() if self.training is not None else {"frozen": self.trainer.frozen_tensors()}

    def current_plan(self) -> Plan:
        return self.training.plan if self.training is not None else self.plan

    def ended(self, outcome: Outcome) -> Outcome:
        """``outcome`` with what this attempt learnt: its plan, measurements and recoveries."""
        self.trackers.attempt_ended(outcome, self.recoveries)
        return dataclasses.replace(
            outcome,
            resumed_from=self.progress.resumed_from,
            plan=self.current_plan(),
            measurements=tuple(self.measurements + _steady(self.records)),
            recoveries=tuple(self.recoveries),
        )

    def oom_outcome(self, error: torch.OutOfMemoryError, bucket: tuple[int, int] | None = None) -> Outcome:
        """The OOM as an Outcome; in a step of ``bucket`` (when steps differ in size), with the
        shape of the micro-batch in flight."""
        figures = self.memory.oom_figures(str(error))
        self.measurements.append(oom_measurement(self.current_plan(), figures, self.training, self.progress.step))
        shape = (self.buckets.micro_batch(self.current_plan(), bucket), bucket[1], bucket[0]) if bucket is not None else None
        return Outcome(kind="oom", step=self.progress.step, phase=self.control.phase, memory=figures, message=str(error), batch_shape=shape)

    def _bucket(self) -> tuple[int, int] | None:
        """The current step's bucket as (width, height), when steps differ in size."""
        bucket = self.trainer.step_bucket(self.progress.step)
        return (bucket.width, bucket.height) if bucket is not None else None

    # -- start: probe, build, resume ---------------------------------------------------------

    def start(self) -> Outcome | None:
        """Build the training, from the newest usable checkpoint or fresh (after the probe,
        when the attempt asks for one); the Outcome that ended the attempt already, if any."""
        latest, weights = _newest_usable(self.checkpoints_dir, self.memory, self.say)
        self.memory.begin_step(latest.step if latest is not None else 0)
        if latest is not None:
            # Where the attempt stands, should the plan not even fit while it is built.
            self.progress.step = self.progress.last_checkpoint = latest.step
            # Nothing is built yet: any plan the job stepped down from in earlier attempts that
            # fits the room there is now is a step up without a restart.
            capacity = self.ranks.smallest(self.memory.capacity())
            up = self.ranks.from_main(lambda: self.step_ups.at_start(latest.step, self.plan, capacity))
            if up is not None:
                self.recoveries.append(up)
                self.say(f"at step {up['step']}: {up['reason']}")
                self.plan = Plan.from_dict(up["to"])
        # Before the probe: what it measures, and what it counts as left behind, is on top.
        self.control.phase = "setup"
        self.trainer.place_frozen(self.plan, self.device, self.memory)
        if self.config.probe and latest is None:
            failure = self._probe()
            if failure is not None:
                return failure
        self.control.phase = "setup"
        if latest is None:
            self.training = build_training(self.trainer, self.job, self.plan, self.device, self.memory, ranks=self.ranks)
            self.say("no checkpoint: starting at step 0")
            return None
        self.training = build_training(self.trainer, self.job, self.plan, self.device, self.memory, weights, ranks=self.ranks)
        del weights
        self._resume(latest)
        return None

    def _probe(self) -> Outcome | None:
        probed = run_probe(self.trainer, self.job, self.plan, self.device, self.memory, self.control, self.say, self.ranks)
        self.measurements.extend(probed.measurements)
        if probed.plan != self.plan:
            # Left for lack of room (what the probe measured says the job's own plan does not fit),
            # or only because another plan is faster, or for want of a measurement: then it is not
            # a plan to step back up to (at the same room it would be a step into the unknown).
            capacity = self.ranks.smallest(self.memory.capacity())
            for_room = capacity is not None and MemoryModel(probed.measurements).fits(self.plan, capacity) is False
            self.recoveries.append(
                {"step": 0, "from": self.plan.to_dict(), "to": probed.plan.to_dict(), "reason": probed.reason, "for_room": for_room}
            )
        self.plan = probed.plan
        self.say(probed.reason)
        return probed.failure

    def _resume(self, latest: checkpoints.Checkpoint) -> None:
        """Load the checkpoint's optimizer, scheduler, scaler and RNG states (its weights are
        in the training already) and go on from its step."""
        training = self.training
        assert training is not None
        with self.memory.paused():
            train_state.load_rest(
                latest.path, optimizer=training.optimizer, lr_scheduler=training.lr_scheduler, scaler=training.scaler, plan=self.plan, say=self.say,
                model=training.model, sharded=training.shards is not None,
            )
        self.memory.track(training.device_tensors()["optimizer_state"])
        self.progress.step = self.progress.last_checkpoint = self.progress.resumed_from = latest.step
        # The checkpoint is read into host memory and each tensor moved on its own: the device
        # never holds a second copy of the state, and a resume needs no more than a step.
        peak = self.memory.peak_bytes()
        held = f"; device peak while resuming: {peak} bytes ({format_mib(peak)})" if peak is not None else ""
        self.say(f"resumed from checkpoint at step {latest.step} ({latest.path.name}){held}")

    # -- the steps ---------------------------------------------------------------------------

    def _stopped_on_request(self) -> Outcome:
        """Stopped by SIGTERM, or by SIGUSR1 before a cluster's time limit, after a checkpoint."""
        signalled_at = self.control.time_limit_signal_at
        if signalled_at is None:
            return Outcome(kind="interrupted", step=self.progress.step, message="stopped on request (SIGTERM) after a checkpoint")
        kept = "after a checkpoint" if self.progress.last_checkpoint == self.progress.step else "with nothing new to checkpoint"
        return Outcome(
            kind="time_limit", step=self.progress.step,
            message=f"the cluster's time limit is near (SIGUSR1): stopped at step {self.progress.step} {kept}, "
            f"{time.monotonic() - signalled_at:.1f} s after the signal",
        )

    def run_steps(self, metrics: IO[str]) -> Outcome | None:
        """Train to the job's max_steps (None) or to the Outcome that ends the attempt first."""
        self.last_checkpoint_time = time.monotonic()
        self.steps_in_process = 0
        while self.progress.step < self.job.train.max_steps:
            if self._stop_agreed():
                # Nothing to keep before the first step: the next attempt starts over.
                if self._has_unsaved_steps():
                    self.save_checkpoint()
                return self._stopped_on_request()
            result = self._step()
            if isinstance(result, Outcome):
                ending = self._after_oom(result)
                if ending is None:
                    # Nothing of the step was applied: run the same step again.
                    continue
                return ending
            if not math.isfinite(result.loss):
                return Outcome(kind="diverged", step=self.progress.step, phase="forward", message=f"loss is {result.loss} at step {self.progress.step}")
            ending = self._after_step(result, metrics)
            if ending is not None:
                return ending
        return None

    def _stop_agreed(self) -> bool:
        """Whether the ranks stop here (any rank was asked to: they all are, at about the same
        moment); a time limit's signal on any rank counts for all."""
        stop, time_limit = self.ranks.any([self.control.stop_requested, self.control.time_limit_signal_at is not None])
        if time_limit and self.control.time_limit_signal_at is None:
            self.control.time_limit_signal_at = time.monotonic()
        return stop

    def _step(self) -> StepResult | Outcome:
        """One optimizer step, or the Outcome of the OOM that stopped it (of every rank: an OOM
        of one rank before the gradients are averaged is all ranks', the first rank's figures)."""
        assert self.training is not None
        self.memory.begin_step(self.progress.step)
        self.memory.reset_peak()
        bucket = self._bucket()
        try:
            return one_step(self.trainer, self.training, self.progress.step, self.memory, self.control, self.buckets.micro_batch(self.training.plan, bucket))
        except torch.OutOfMemoryError as error:
            # Keep only numbers and text: the traceback holds the step's tensors, and they
            # must be freed (when this returns) before anything else is allocated.
            oom = self.oom_outcome(error, bucket)
        except PeerOutOfMemory:
            oom = None
        agreed = agreed_oom(self.ranks, self.training.shards is not None, oom)
        assert agreed is not None  # some rank failed
        if oom is None:  # another rank's: what this one measures too
            self.measurements.append(oom_measurement(self.current_plan(), agreed.memory, self.training, self.progress.step))
        return agreed

    def _after_oom(self, oom: Outcome) -> Outcome | None:
        """After an OOM in a step: free what the step held and go on in this process when it
        can (None); else the Outcome that ends the attempt. A step up on trial goes back to the
        plan that worked, whatever ran out (in this process, or in a new one: "replan")."""
        training = self.training
        assert training is not None
        free(self.memory, training)
        leftover = self.ranks.largest(unfit_to_continue(self.memory, training.resident_bytes()) or 0) or None
        change = self.ranks.from_main(lambda: self._answer_to_oom(oom, leftover))
        if change is None:
            return self._end_on_oom(oom)
        if change.get("restart"):
            return self.replan(change, after=oom)
        if "bucket" in change:
            # The plan stays; one bucket's steps go in smaller slices (announced when chosen).
            self.recoveries.append(change)
            self.buckets.take(training.plan, change)
            return None
        # A rung's change was announced as it was chosen; a step up's way back is now.
        self._change_plan(change, announce="direction" in change)
        return None

    def _answer_to_oom(self, oom: Outcome, leftover: int | None) -> dict[str, Any] | None:
        """Rank 0's answer to an OOM in a step: the change of plan (with "restart" when it takes
        a new process), or None when the attempt ends on it."""
        training = self.training
        assert training is not None
        back = self.step_ups.after_oom(self.progress.step, training.plan, describe_oom(oom))
        if back is not None:
            if back["restart"] or leftover is not None or oom.phase not in IN_PROCESS_PHASES:
                back["restart"] = True  # half-updated weights, memory left behind, or a rung that needs it
            return back
        return self._recovery_in_process(oom, leftover)

    def _recovery_in_process(self, oom: Outcome, leftover: int | None) -> dict[str, Any] | None:
        """When this process can go on after ``oom`` (its step's tensors freed) and the doctor
        has a rung for it, the change to that rung's plan."""
        training = self.training
        assert training is not None
        record = self.records.get(training.plan)
        contention = find_contention(oom.memory, max(record.reserved or record.peaks) if record and record.peaks else None)
        if contention is not None:
            # Not the job's doing: no rung. The daemon waits for the memory to come back and
            # runs the same plan from the checkpoint.
            self.say(f"out of memory in {oom.phase} at step {self.progress.step}: {contention.describe()}; stopping for the daemon to wait")
            return None
        if leftover is not None:
            self.say(f"the failed step left {format_mib(leftover)} behind on the device: a new process must take over")
            return None
        if oom.phase not in IN_PROCESS_PHASES or not self.config.recover_in_process or len(self.recoveries) >= MAX_RECOVERIES:
            return None
        bucket = self._bucket()
        spike = self.buckets.answer(training.plan, bucket, oom, self.progress.step) if bucket is not None else None
        if spike is not None:
            self.say(f"out of memory in {oom.phase} at step {self.progress.step}; {spike['reason']}")
            return spike
        total = oom.memory.total if oom.memory else None
        recovery = decide_in_process(training.plan, self.measurements + _steady(self.records), self.job.policy(), total)
        if recovery is None:
            return None
        self.say(f"out of memory in {oom.phase} at step {self.progress.step}; {recovery.reason}")
        return {
            "step": self.progress.step, "from": training.plan.to_dict(), "to": recovery.plan.to_dict(), "reason": recovery.reason,
            "oom": describe_oom(oom),
        }

    def replan(self, change: dict[str, Any], after: Outcome | None = None) -> Outcome:
        """End the attempt for a new process to go on under ``change``'s plan (a step up, or the
        way back from one, that needs a restart), from the newest checkpoint: after ``after``,
        the OOM it answers, the steps since the last checkpoint are kept first (recorded before:
        a full disk then ends the attempt waiting for room, under the plan it goes to)."""
        self.recoveries.append(change)
        self.replanned_to = Plan.from_dict(change["to"])
        if after is not None:
            self._end_on_oom(after)
        what = f"{change['oom']}; {change['reason']}" if isinstance(change.get("oom"), str) else change["reason"]
        self.say(f"at step {change['step']}: {what}")
        return Outcome(kind="replan", step=self.progress.step, next_plan=Plan.from_dict(change["to"]), message=what)

    def _end_on_oom(self, oom: Outcome) -> Outcome:
        # The state is consistent unless the OOM hit inside optimizer.step, where parameters
        # may be half updated: then the last checkpoint stands.
        if oom.phase != "optimizer" and self._has_unsaved_steps():
            self.save_checkpoint()
        return oom

    def _after_step(self, result: StepResult, metrics: IO[str]) -> Outcome | None:
        """Record the step's steady-state figures, count it, report it, checkpoint when due (and
        step back up there: the Outcome that ends the attempt, when that takes a new process)."""
        training = self.training
        assert training is not None
        self.steps_in_process += 1
        samples_per_s = self.job.train.batch_size / result.seconds
        bucket = self._bucket()
        if bucket is not None:
            self.buckets.fitted(training.plan, bucket)
        if self.steps_in_process > 1:
            record = self.records.setdefault(training.plan, PlanRecord())
            record.peaks.append(self.memory.peak_bytes() or 0)
            reserved = self.memory.peak_reserved()
            if reserved is not None:
                record.reserved.append(reserved)
            record.rates.append(samples_per_s)
            record.capacity = self.memory.capacity()
            record.static = training.static_bytes()
        self.progress.step += 1
        if self.after_step is not None:
            self.after_step(training, self.progress.step)
        self.memory.publish()
        if self.ranks.main:
            report_step(
                self.attempt_dir, metrics, self.progress, self.job.train.max_steps, result.loss, training.lr_scheduler.get_last_lr()[0], samples_per_s,
                self.memory, training.plan.short(), self.recoveries, self.trackers,
            )
        if self.sampler is not None and self.sampler.due(self.progress.step):
            self.control.phase = "sampling"
            self.sampler.render(training, self.progress.step, self.memory)
        train = self.job.train
        due_by_steps = self.progress.step % train.checkpoint_every_steps == 0
        due_by_time = train.checkpoint_every_seconds is not None and self.ranks.from_main(
            lambda: time.monotonic() - self.last_checkpoint_time >= train.checkpoint_every_seconds
        )
        if (due_by_steps or due_by_time) and self.progress.step < train.max_steps:
            self.save_checkpoint()
            self.last_checkpoint_time = time.monotonic()
            capacity = self.ranks.smallest(self.memory.capacity())  # the plan must fit every rank
            up = self.ranks.from_main(lambda: self.step_ups.at_checkpoint(
                self.progress.step, training.plan, self.recoveries, self.measurements + _steady(self.records), capacity,
                may_step=len(self.recoveries) < MAX_RECOVERIES,
            ))
            if up is not None:
                if up["restart"]:
                    return self.replan(up)
                self._change_plan(up)
        return None

    def _change_plan(self, change: dict[str, Any], announce: bool = True) -> bool:
        """Switch the running training to a step's plan (back up, or back down, or a rung after
        an OOM, announced when it was chosen), recorded."""
        assert self.training is not None
        self.recoveries.append(change)
        if announce:
            self.say(f"at step {change['step']}: {change['reason']}")
        self.training.apply(Plan.from_dict(change["to"]))
        return True

    def _has_unsaved_steps(self) -> bool:
        return self.progress.last_checkpoint != self.progress.step and self.progress.step > 0

    def save_checkpoint(self) -> None:
        """Rank 0 writes the checkpoint; with a sharded model every rank writes its shards into
        it (rank 0 names the folder), and no rank goes on before it is complete."""
        training = self.training
        assert training is not None
        self.control.phase = "checkpoint"
        step = self.progress.step
        sharded = training.shards is not None
        if not self.ranks.main:
            if sharded:
                with self.memory.paused():
                    train_state.save_shards(Path(self.ranks.from_main(None)), training.model, training.optimizer)
            self.ranks.barrier()
            self.progress.last_checkpoint = step
            return

        def write_state(directory: Path) -> None:
            groups = None
            if sharded:
                self.ranks.from_main(str(directory))
                groups = train_state.save_shards(directory, training.model, training.optimizer)
            train_state.save(
                directory,
                weights=None if sharded else training.weights(),
                optimizer=training.optimizer,
                lr_scheduler=training.lr_scheduler,
                scaler=training.scaler,
                plan=training.plan,
                step=step,
                job_name=self.job.name,
                shard_groups=groups,
            )

        train = self.job.train
        with self.memory.paused():
            need = checkpoint_need(self.checkpoints_dir, training, self.job.resources.disk, train.keep_every_steps, self.say)
            with room_for(self.checkpoints_dir, need, "a checkpoint"):
                saved = checkpoints.save(
                    self.checkpoints_dir, step, training.plan.to_dict(), writing_into(write_state), train.keep_checkpoints, train.keep_every_steps,
                )
        self.ranks.barrier()
        self.progress.last_checkpoint = step
        self.say(f"checkpoint at step {step} ({saved.path.name})")

    # -- the end -----------------------------------------------------------------------------

    def finish(self) -> Outcome:
        """Write the final model (all steps are done)."""
        assert self.training is not None
        self.control.phase = "checkpoint"
        final_dir = self.config.workdir / "final"
        with self.memory.paused():
            model = self._whole_model()
            if self.ranks.main:
                with room_for(final_dir.parent, final_need(self.training), "the final model"):
                    _save_final(self.trainer, model, final_dir)
        self.ranks.barrier()
        self.say(f"finished: {self.progress.step} steps; final model in {final_dir}")
        return Outcome(kind="finished", step=self.progress.step)


    def _whole_model(self) -> torch.nn.Module | None:
        """The final model on rank 0 (None on the others): a sharded model's shards gathered
        (every rank takes part) into a model built on the host."""
        training = self.training
        assert training is not None
        if training.shards is None:
            return training.final_model() if self.ranks.main else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(training.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.ranks.main:
            return None
        model = self.trainer.build_model()
        model.load_state_dict(whole)
        return model


def _newest_usable(
    checkpoints_dir: Path, memory: DeviceMemory, say: Callable[[str], None]
) -> tuple[checkpoints.Checkpoint | None, train_state.ModelWeights | None]:
    """The newest checkpoint that verifies and whose weights are finite, with its weights: a
    run that diverged may have saved NaN weights before its loss showed it."""
    for checkpoint in checkpoints.valid_newest_first(checkpoints_dir, warn=say):
        with memory.paused():
            weights = train_state.load_weights(checkpoint.path, Plan.from_dict(checkpoint.plan))
        if train_state.finite(weights):
            return checkpoint, weights
        say(f"skipping checkpoint {checkpoint.path.name}: its weights hold NaN or inf (the run diverged before it was written)")
    return None, None


def _steady(records: dict[Plan, PlanRecord]) -> list[Measurement]:
    return [
        Measurement(
            plan=p, fits=True, peak_bytes=max(r.peaks), capacity=r.capacity, samples_per_s=statistics.median(r.rates), static=r.static,
            reserved_bytes=max(r.reserved) if r.reserved else None,
        )
        for p, r in records.items()
        if r.peaks
    ]


def _save_final(trainer: Trainer, model: torch.nn.Module, final_dir: Path) -> None:
    """Write the final model atomically: a `final/` directory is always complete."""
    temporary = final_dir.with_name(final_dir.name + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        trainer.save_final(model, temporary)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)  # a full disk's partial write: its room is needed
        raise
    if final_dir.exists():
        shutil.rmtree(final_dir)
    temporary.rename(final_dir)
