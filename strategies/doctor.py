"""The doctor: from what an attempt ended with and the job's history, the next thing to do.

Diagnose first (what ran out), then act: fragmentation -> the allocator rung; otherwise the
cheapest allowed rung that gives a plan which has not already run out of memory. Every answer
carries a reason in words, recorded as an event and shown to people.

Over 400 lines on purpose: the decision after an OOM and the report that explains it read the
same history and policy, and the typed answers, the OOM texts and the policy already live in
their own modules (decision.py, oom_*.py, policy.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from oomguard.strategies import planner, rungs
from oomguard.strategies.contention import Contention, bytes_to_wait_for, find_contention
from oomguard.strategies.doctor_cluster import after_time_limit, continues, more_host_memory
from oomguard.strategies.decision import Decision, GiveUp, NextPlan, PastAttempt, Retry, Wait, own_plan
from oomguard.strategies.doctor_disk import after_disk_full
from oomguard.strategies.doctor_width import NARROW, at_width, rungs_taken, widened_candidates
from oomguard.strategies.memory_model import Measurement, MemoryModel
from oomguard.strategies.oom_judge import fragmentation_evidence, is_fragmentation
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import Rung
from oomguard.strategies.planner import candidate_plans, rungs_between, with_process_settings
from oomguard.strategies.policy import Policy
from oomguard.strategies.step_up_history import after_failed_launch_step_up, after_replan, failed_launch_step_up, free_replan
from oomguard.strategies.units import format_bytes


# Crash retry n (from 1) waits this long times 3**(n-1), at most CRASH_BACKOFF_MAX_SECONDS.
CRASH_BACKOFF_SECONDS = 5.0
CRASH_BACKOFF_MAX_SECONDS = 300.0


# What the ladder is for: a job that failed of anything else gets no advice about rungs.
MEMORY_KINDS = ("oom", "host_oom")

# What the job's owner does after the job failed, by how its last attempt ended.
NEXT_STEPS = {
    "oom": "change the job file (e.g. allow the rungs the report names) and submit it again",
    "host_oom": "host memory (RAM) ran out: free some on the machine, or change the job file (e.g. allow the rungs the "
    "report names), and submit it again",
    "crashed": "fix the script and resubmit: it died of the error quoted above",
    "diverged": "look at the job's learning rate and data, and submit it again",
}
NEXT_STEP_OTHERWISE = "look at the job's logs (`oomguard logs`) and submit it again"

# Errors that come from the machine rather than the script (a full disk, a lost mount): they may
# pass, so a crash with one keeps its backed-off retries even when it repeats exactly.
MACHINE_TROUBLE = re.compile(r"No space left on device|Disk quota exceeded|Input/output error|Stale file handle|Transport endpoint is not connected")



def describe_oom(outcome: Outcome) -> str:
    where = f"in {outcome.phase}" if outcome.phase else ""
    text = f"out of memory {where} at step {outcome.step}".replace("  ", " ")
    if outcome.batch_shape is not None:
        samples, height, width = outcome.batch_shape
        text += f" (a micro-batch of {samples} at {width}x{height} px)"
    memory = outcome.memory
    if memory is not None:
        text += (
            f": tried to allocate {format_bytes(memory.requested)} with {format_bytes(memory.allocated)}"
            f" of {format_bytes(memory.total)} in use"
        )
        consumer = memory.dominant_consumer()
        if consumer:
            text += f"; largest consumer: {consumer} ({format_bytes(memory.breakdown[consumer])})"
    return text


def decide(outcome: Outcome, plan: Plan, history: Sequence[PastAttempt], policy: Policy) -> Decision:
    """The next step after ``outcome`` of an attempt under ``plan``.

    ``history`` holds the job's earlier attempts, this one included.
    """
    # A rung under which the loss diverged is unsafe for this job: never taken again.
    unsafe = unsafe_rungs(history, policy)
    if unsafe:
        policy = dataclasses.replace(policy, allow=tuple(name for name in policy.allow if name not in unsafe), unsafe=unsafe)
    # Interruptions, neighbours' spikes and full disks are not the job's doing: they do not use
    # up its tries. A time limit reached after a checkpoint is a continuation: it costs no try
    # either, nor does a step back up (strategies/step_up_history.py), held or not.
    counted = [
        past for at, past in enumerate(history)
        if not continues(past.outcome, history[:at]) and contention_of(past) is None and past.outcome.kind != "disk_full"
        and not free_replan(past, history[:at]) and not failed_launch_step_up(past)
    ]
    if outcome.kind == "disk_full":
        return after_disk_full(outcome, plan, history)
    if history and failed_launch_step_up(history[-1]) and len(history) >= 2:
        return after_failed_launch_step_up(outcome, history, describe_oom(outcome))
    if len(counted) >= policy.max_attempts:
        return give_up(f"{len(counted)} attempts made, the job's limit (ladder.max_attempts) is {policy.max_attempts}", history, policy)
    if outcome.kind == "interrupted":
        return Retry(reason="the attempt was interrupted; it continues from its checkpoint")
    if outcome.kind == "time_limit":
        return after_time_limit(outcome, plan)
    if outcome.kind == "replan":
        return after_replan(outcome, plan, history, policy)
    if outcome.kind == "host_oom" and outcome.host_memory_limit is not None:
        return more_host_memory(outcome, plan)
    if outcome.kind in ("crashed", "host_oom"):
        return _after_crash(outcome, plan, history, policy)
    if outcome.kind == "diverged":
        return _after_divergence(outcome, plan, history, policy, unsafe)
    if outcome.kind == "oom":
        contention = find_contention(outcome.memory, steady_peak(outcome, plan))
        if contention is not None:
            return _after_contention(contention, outcome, plan, history, policy)
        return _after_oom(outcome, plan, history, policy)
    raise ValueError(f"no decision to make after an attempt that ended {outcome.kind!r}")


def unsafe_rungs(history: Sequence[PastAttempt], policy: Policy) -> tuple[str, ...]:
    """The approximate rungs (they change the numerics) that a plan held when the job's loss
    diverged under it, beyond what the job's own plan has."""
    if not history:
        return ()
    origin = policy.initial or history[0].plan
    unsafe = {
        name for past in history if past.outcome.kind == "diverged"
        for name in rungs_between(origin, past.plan) if not _rung(name).exact
    }
    return tuple(name for name in rungs.names() if name in unsafe)


def _rung(name: str) -> rungs.Rung:
    """A rung the planner named (it names only rungs on the ladder)."""
    found = rungs.rung(name)
    assert found is not None, name
    return found


def _after_divergence(outcome: Outcome, plan: Plan, history: Sequence[PastAttempt], policy: Policy, unsafe: tuple[str, ...]) -> Decision:
    """The loss went NaN/inf. Under a rung that changes the numerics (precision, the 8-bit
    optimizer, ...): the rung is marked unsafe, the plan goes back to the job's own setting
    of that knob, and the next attempt resumes from the newest checkpoint whose weights are
    finite (the runner skips the others). Under the job's own numerics: a person must look."""
    diverged = f"the loss diverged at step {outcome.step} under [{plan.short()}] ({outcome.message.strip() or 'NaN/inf'})"
    origin = _origin(plan, history, policy)
    taken = [name for name in rungs_between(origin, plan) if name in unsafe]
    if not taken:
        return give_up(f"{diverged}; the job's own settings diverge: look at its learning rate and data", history, policy)
    reverted = plan
    for name in taken:
        reverted = _rung(name).set(reverted, _rung(name).get(origin))
    diagnosis = f"{diverged}; {', '.join(taken)} marked unsafe for this job"
    # Plans that ran out of memory, in an attempt or when measured (the probe).
    failed = {past.plan for past in history if past.outcome.kind == "oom" and contention_of(past) is None}
    failed |= {m.plan for m in measurements_of(history) if not m.fits}
    if reverted not in failed:
        return NextPlan(
            plan=reverted, rung="undo:" + "+".join(taken),
            reason=f"{diagnosis} -> back to [{reverted.short()}], from the newest checkpoint whose weights are finite",
        )
    # The plan without the unsafe rung does not fit: the ladder goes on from it, without the
    # rung, at the capacity the job saw last.
    failed.add(reverted)
    capacities = [past.outcome.memory.total for past in history if past.outcome.memory is not None and past.outcome.memory.total]
    capacities += [m.capacity for m in measurements_of(history) if m.capacity]  # the latest last
    decision = _plan_by_numbers(outcome, reverted, history, policy, capacities[-1], failed, diagnosis) if capacities else None
    return decision or _walk_ladder(outcome, reverted, history, policy, failed, diagnosis)


def steady_peak(outcome: Outcome, plan: Plan) -> int | None:
    """The peak ``plan`` had over its steady steps in the attempt, when it ran any."""
    peaks = [m.held_bytes for m in outcome.measurements if m.fits and m.plan == plan]
    return max(peaks) if peaks else None


def contention_of(past: PastAttempt) -> Contention | None:
    if past.outcome.kind != "oom":
        return None
    return find_contention(past.outcome.memory, steady_peak(past.outcome, past.plan))


def _after_contention(contention: Contention, outcome: Outcome, plan: Plan, history: Sequence[PastAttempt], policy: Policy) -> Decision:
    streak = 0
    for past in reversed(history):
        if contention_of(past) is None:
            break
        streak += 1
    if streak > policy.max_waits:
        return give_up(
            f"other processes took the GPU's memory {streak} times in a row; free the GPU or move the job", history, policy,
            next_step="free the GPU (`oomguard gpus` shows what is on it) or move the job, and submit it again",
        )
    free_bytes = bytes_to_wait_for(contention, steady_peak(outcome, plan))
    return Wait(
        reason=f"{describe_oom(outcome)}; {contention.describe()} -> wait until {format_bytes(free_bytes)} are free, "
        f"then run the same plan [{plan.short()}] again (no rung for a neighbour's spike)",
        free_bytes=free_bytes,
    )


def _after_crash(outcome: Outcome, plan: Plan, history: Sequence[PastAttempt], policy: Policy) -> Decision:
    if repeats_last_crash(outcome, plan, history):
        return give_up(
            f"the attempt crashed twice in a row at step {outcome.step} with the same error: {outcome.error_line}", history, policy,
        )
    # Count the crashes of this plan since its last good sign (an OOM or an interruption
    # means the crash streak of an earlier plan does not carry over).
    streak = 0
    for past in reversed(history):
        if past.plan != plan or past.outcome.kind not in ("crashed", "host_oom"):
            break
        streak += 1
    retries_used = streak - 1
    # Host memory running out is not the device's: no rung saves it, and it is usually another
    # process's doing (or a passing peak), so it is retried after the same pause as a crash.
    ended = "crashed" if outcome.kind == "crashed" else "ran out of host memory"
    if retries_used < policy.crash_retries:
        delay = min(CRASH_BACKOFF_SECONDS * 3**retries_used, CRASH_BACKOFF_MAX_SECONDS)
        return Retry(
            reason=f"the attempt {ended} ({outcome.summary or 'no message'}); "
            f"retry {retries_used + 1} of {policy.crash_retries} with the same plan in {delay:.0f} s",
            after_seconds=delay,
        )
    return give_up(f"the attempt {ended} {streak} times in a row with the same plan: {outcome.summary}", history, policy)


def repeats_last_crash(outcome: Outcome, plan: Plan, history: Sequence[PastAttempt]) -> bool:
    """The attempt crashed as the one before it did: the same plan, the same step (step 0 too:
    neither got going), the same exception line. A script's own bug (a mistyped path, a missing
    file, a wrong argument) does that at every try, so retrying it only delays the news; a
    machine's trouble (MACHINE_TROUBLE) and a crash that names no exception keep their retries."""
    line = outcome.error_line
    if outcome.kind != "crashed" or line is None or MACHINE_TROUBLE.search(line) or len(history) < 2:
        return False
    before = history[-2]
    return before.plan == plan and before.outcome.kind == "crashed" and before.outcome.step == outcome.step and before.outcome.error_line == line


def give_up(
    reason: str, history: Sequence[PastAttempt], policy: Policy, needed: Sequence[str] = (), next_step: str | None = None, *, advice: bool = True,
) -> GiveUp:
    """Stop, with the report, and the next step for what the last attempt ended with.
    ``advice``: whether the report may name rungs to allow."""
    kind = history[-1].outcome.kind if history else ""
    return GiveUp(
        reason=reason, report=report(history, policy, needed, advice=advice), next_step=next_step or NEXT_STEPS.get(kind, NEXT_STEP_OTHERWISE),
    )


def measurements_of(history: Sequence[PastAttempt]) -> list[Measurement]:
    return [m for past in history for m in past.outcome.measurements]


def _origin(plan: Plan, history: Sequence[PastAttempt], policy: Policy) -> Plan:
    """The job's own plan (nothing saved) with the process settings (the allocator) now in
    force: the planner searches everything reachable from it, so it may also undo a rung (but
    never a cure for fragmentation, which it does not weigh)."""
    return with_process_settings(own_plan(policy, history, plan), plan)


# A smaller micro-batch whose steady peak is at least this share of the larger one's did not
# shrink the step: activations grow with the micro-batch, so an honoured halving takes them
# down by half (the weights and optimizer state stay).
UNMOVED_PEAK = 0.97


def ignored_micro_batch(outcome: Outcome, plan: Plan, history: Sequence[PastAttempt], policy: Policy) -> str | None:
    """Why the script seems not to use the micro-batch its command passes on, when it does:
    the attempt before this one ran out of memory with a larger micro-batch, and this one,
    with the smaller, failed the same allocation at the same size, or took the same steady
    peak. None otherwise (and always for the built-in trainer)."""
    if policy.micro_batch_argument is None or outcome.kind != "oom" or len(history) < 2:
        return None
    before = history[-2]
    if before.outcome.kind != "oom" or not plan.micro_batch < before.plan.micro_batch or contention_of(before) is not None:
        return None
    now_memory, then_memory = outcome.memory, before.outcome.memory
    requested = now_memory.requested if now_memory is not None else None
    if requested and then_memory is not None and then_memory.requested == requested:
        return f"the same {format_bytes(requested)} allocation failed with {plan.micro_batch} samples as with {before.plan.micro_batch}"
    peak_now, peak_then = steady_peak(outcome, plan), steady_peak(before.outcome, before.plan)
    if peak_now and peak_then and peak_now >= UNMOVED_PEAK * peak_then:
        return (
            f"a step took {format_bytes(peak_now)} with {plan.micro_batch} samples and {format_bytes(peak_then)} with "
            f"{before.plan.micro_batch}"
        )
    return None


def _after_oom(outcome: Outcome, plan: Plan, history: Sequence[PastAttempt], policy: Policy) -> Decision:
    # A plan that ran out of memory is never run again (unless a neighbour made it run out).
    failed = {past.plan for past in history if past.outcome.kind == "oom" and contention_of(past) is None} | {plan}
    diagnosis = describe_oom(outcome)
    unmoved = ignored_micro_batch(outcome, plan, history, policy)
    if unmoved is not None:
        # No rung is worth taking (or suggesting) while the script's batch does not follow the
        # plan: each would be judged on a batch the script never ran.
        return give_up(
            f"{diagnosis}; the micro-batch was halved and nothing moved ({unmoved}): the script probably does not honour "
            f"{{micro_batch}}, which the job passes as {policy.micro_batch_argument!r}",
            history, policy, advice=False,
            next_step=f"make the script take its batch size from {policy.micro_batch_argument!r} (the {{micro_batch}} placeholder), "
            "or write the argument the script does read, and submit the job again",
        )
    memory = outcome.memory
    if is_fragmentation(memory):
        for rung in rungs.ladder():
            if not rung.cures_fragmentation or rung.name not in policy.allow:
                continue
            new_plan = rung.step(plan)
            if new_plan is not None and new_plan not in failed:
                diagnosis += f"; {fragmentation_evidence(memory)}: fragmentation"  # type: ignore[arg-type]
                return NextPlan(plan=new_plan, rung=rung.name, reason=f"{diagnosis} -> {rung.describe(plan, new_plan)}")
    if outcome.phase == "setup":
        diagnosis += "; the model and its state do not fit before training starts"
    capacity = memory.total if memory is not None else None
    if capacity:
        # A plan measured out of memory at this capacity or more (by the probe) is failed too:
        # the model's knowing that it does not fit says nothing about the plans never measured.
        failed |= {m.plan for m in measurements_of(history) if not m.fits and (m.capacity is None or m.capacity >= capacity)}
        decision = _plan_by_numbers(outcome, plan, history, policy, capacity, failed, diagnosis)
        if decision is not None:
            return decision
    return _walk_ladder(outcome, plan, history, policy, failed, diagnosis)


def _plan_by_numbers(
    outcome: Outcome, plan: Plan, history: Sequence[PastAttempt], policy: Policy, capacity: int, failed: set[Plan], diagnosis: str
) -> Decision | None:
    """The planner's answer from the memory model; None when the model knows too little."""
    model = MemoryModel(measurements_of(history))
    origin = _origin(plan, history, policy)
    allowed = [p for p in widened_candidates(origin, plan, policy) if p not in failed]
    if all(model.fits(p, capacity) is None for p in allowed):
        return None
    choice = planner.choose(origin, allowed, model, capacity)
    if choice is not None:
        return NextPlan(plan=choice.plan, rung=rungs_taken(plan, choice.plan), reason=f"{diagnosis} -> {choice.summary(capacity)}")
    # No plan fits with the margins of predictions (8 % for a shape's own line, 15 % for one
    # carried over by the rungs' factors, which are rounded from this project's UNet2DModel; a
    # Stable Diffusion UNet's differ: bench/results/ladder-t2i.md). A plan that may fit with the
    # margin of a plan that ran is worth an attempt before giving up: it fails at most once, and
    # never runs again.
    hopeful = planner.choose(origin, allowed, model, capacity, optimistic=True)
    if hopeful is not None:
        return NextPlan(
            plan=hopeful.plan, rung=rungs_taken(plan, hopeful.plan),
            reason=f"{diagnosis} -> {hopeful.summary(capacity)}, the closest plan to fitting (no plan is predicted to fit with a full margin)",
        )
    everything = [p for p in candidate_plans(origin, [n for n in policy.usable if n not in policy.unsafe]) if p not in failed]
    wider = planner.choose(origin, everything, model, capacity)
    if wider is not None:
        needed = [name for name in rungs_between(origin, wider.plan) if name not in policy.allow]
        return give_up(
            f"{diagnosis}; no plan the job allows fits {format_bytes(capacity)}; {wider.summary(capacity)} would, with "
            f"{', '.join(needed)} (not allowed)", history, policy, needed=needed,
        )
    return give_up(f"{diagnosis}; no plan fits {format_bytes(capacity)}, even with every rung oomguard has", history, policy)


def narrowed(plan: Plan, history: Sequence[PastAttempt], policy: Policy, width: int, capacity: int) -> NextPlan | None:
    """The plan a widened job goes on under on ``width`` processes (fewer), to give GPUs back
    to a job waiting for them: the best the memory model says fits ``capacity`` per GPU; None
    when none does (the job keeps its GPUs)."""
    origin = _origin(plan, history, policy)
    start = at_width(origin, width)
    failed = {past.plan for past in history if past.outcome.kind == "oom" and contention_of(past) is None}
    candidates = [p for p in candidate_plans(start, policy.allow) if p not in failed]
    choice = planner.choose(origin, candidates, MemoryModel(measurements_of(history)), capacity)
    if choice is None:
        return None
    return NextPlan(plan=choice.plan, rung="+".join((NARROW, *rungs_between(plan, choice.plan))), reason=f"back onto {width} GPU(s): {choice.summary(capacity)}")


def _walk_ladder(outcome: Outcome, plan: Plan, history: Sequence[PastAttempt], policy: Policy, failed: set[Plan], diagnosis: str) -> Decision:
    """Without numbers: the first allowed rung that gives a plan not yet run out of memory;
    exact rungs before approximate ones, and within each, the rungs that shrink the consumer
    that dominated the OOM before the others (then ladder order). Process rungs answer
    fragmentation only."""
    order = [(position, r) for position, r in enumerate(rungs.ladder()) if r.role != "process"]
    if outcome.phase == "setup":
        # Before the first step there are no activations, nor gradients.
        order = [(position, r) for position, r in order if not r.activations_only and not r.shrinks <= {"activations", "gradients"}]
    dominant = outcome.memory.dominant_consumer() if outcome.memory is not None else None
    order.sort(key=lambda item: (not item[1].exact, dominant not in item[1].shrinks, item[0]))
    for _, rung in order:
        if rung.name not in policy.allow:
            continue
        new_plan = _stepped(rung, plan, failed)
        if new_plan is not None:
            return NextPlan(plan=new_plan, rung=rung.name, reason=f"{diagnosis} -> {rung.describe(plan, new_plan)}")
    return give_up(f"{diagnosis}; no allowed rung is left", history, policy)


def _stepped(rung: Rung, plan: Plan, failed: set[Plan]) -> Plan | None:
    """``rung``'s next step from ``plan`` past the plans that ran out of memory; None when it
    has none, or only one the runner cannot run (smaller slices under the step in backward)."""
    new_plan = rung.step(plan)
    while new_plan is not None and new_plan in failed:
        new_plan = rung.step(new_plan)
    return new_plan if new_plan is not None and rungs.conflict(new_plan) is None else None


def decide_in_process(plan: Plan, measurements: Sequence[Measurement], policy: Policy, capacity: int | None) -> NextPlan | None:
    """After an OOM in forward or backward: a plan the running process can switch to (the
    rungs that need no restart), or None when only a new process can help."""
    allowed = [name for name in policy.allow if (r := rungs.rung(name)) is not None and not r.needs_restart]
    failed = {m.plan for m in measurements if not m.fits and (capacity is None or m.capacity is None or m.capacity >= capacity)}
    candidates = [p for p in candidate_plans(plan.replace(micro_batch=plan.per_rank_batch), allowed, restart=False) if p not in failed]
    model = MemoryModel(measurements)
    if capacity is not None and any(model.fits(p, capacity) is not None for p in candidates):
        choice = planner.choose(plan, candidates, model, capacity)
        if choice is None:
            return None
        return NextPlan(plan=choice.plan, rung=rungs_taken(plan, choice.plan), reason=f"in-process -> {choice.summary(capacity)}")
    # No numbers: the allowed in-process rungs in ladder order (halve the micro-batch, then
    # checkpointing, then attention).
    for rung in rungs.ladder():
        if rung.name not in allowed:
            continue
        new_plan = _stepped(rung, plan, failed)
        if new_plan is not None:
            return NextPlan(plan=new_plan, rung=rung.name, reason=f"in-process -> {rung.describe(plan, new_plan)}")
    return None


def report(history: Sequence[PastAttempt], policy: Policy, needed: Sequence[str] = (), *, advice: bool = True) -> str:
    """What was tried, in order; and, when the job ran out of memory, what it could still allow
    (rungs are no answer to a crash or a diverged loss, nor to a script that ignores them:
    ``advice`` False)."""
    lines = ["Attempts:"]
    for number, past in enumerate(history, start=1):
        o = past.outcome
        line = f"  {number}. [{past.plan.short()}] {o.kind} at step {o.step}"
        if o.kind == "oom":
            line += f" ({describe_oom(o)})"
        elif o.summary:
            line += f" ({o.summary})"
        lines.append(line)
    if policy.unsafe:
        lines.append("Rungs marked unsafe for this job (its loss diverged under them): " + ", ".join(policy.unsafe) + ".")
    if advice and history and history[-1].outcome.kind in MEMORY_KINDS:
        lines += _ladder_advice(policy, needed)
    return "\n".join(lines)


def _ladder_advice(policy: Policy, needed: Sequence[str]) -> list[str]:
    """The rungs the job does not allow, and the ``[ladder] allow`` line that would add them."""
    lines = []
    not_allowed = [name for name in policy.usable if name not in policy.allow and name not in policy.unsafe]
    if not_allowed:
        lines.append("Rungs this job does not allow: " + ", ".join(not_allowed) + ".")
    # Suggest the rungs that would make a plan fit, when the memory model knows them; else
    # every rung this version can take (allowing one without code would change nothing).
    could_help = list(needed) or [name for name in not_allowed if rungs.rung(name) is not None]
    if could_help:
        lines.append('To allow more, extend the job file, e.g.: [ladder] allow = [' + ", ".join(f'"{n}"' for n in (*policy.allow, *could_help)) + "]")
    elif not_allowed:
        lines.append("Every rung this version of oomguard implements is already allowed.")
    missing = [name for name in policy.allow if rungs.rung(name) is None]
    if missing:
        lines.append("Allowed but not available in this version of oomguard: " + ", ".join(missing) + ".")
    return lines
