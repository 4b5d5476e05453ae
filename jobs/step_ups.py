"""The runner's side of stepping back up (strategies/step_up.py): at the start of an attempt and
at each checkpoint boundary, the plan to go back up to, if any; and after an OOM while such a
step is on trial (it has not reached a checkpoint boundary yet), the way back to the plan that
worked, with the back-off doubled.

Each change is a record of the attempt's ``recoveries`` (what the heartbeat and outcome.json
carry, and the daemon reports as events), with a ``direction``: "up" for a step up, "back" for
its failure, and ``restart`` when it takes a new process (the runner then ends the attempt as
"replan": jobs/loop.py). The plans a process may step up to are the ones the job stepped down
from for lack of room: in earlier attempts (the StepUpHistory its attempt.json carries) and in
this one (every record's "from" but a step's up or back; the probe's first plan included when
it did not fit: a neighbour that was there when the job started may leave)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.plan import Plan
from oomguard.strategies.step_up import BackOff, in_process_reach, step_up
from oomguard.strategies.step_up_history import BACK, UP, StepUpHistory, left_for_room


class StepUps:
    def __init__(self, history: StepUpHistory | None = None, *, origin: Plan | None = None, in_process: bool = True) -> None:
        self.history = history
        # The job's own plan, against which faithfulness is judged (None: the plan running).
        self.origin = history.origin if history is not None else origin
        # False: the job takes every rung in a new attempt ([ladder] in_process = false).
        self.in_process = in_process
        self.back_off = history.back_off() if history is not None else BackOff()
        # The plan a step up left, while the plan it went to has not reached a checkpoint
        # boundary (the attempt before this one may have stepped up, through a restart).
        self.on_trial_from: Plan | None = history.trial_from if history is not None else None

    def at_start(self, step: int, plan: Plan, capacity: int | None) -> dict[str, Any] | None:
        """Resuming from the checkpoint at ``step``, before anything is built: the step up to
        take now (any plan: nothing needs a restart yet), as a recoveries record. Not while a
        step up made by the attempt before is on trial."""
        if self.history is None or self.on_trial_from is not None or self.back_off.waiting():
            return None  # a wait after a step up that failed counts in boundaries, not starts
        return self._step_up(step, plan, (), (), capacity, at_start=True)

    def at_checkpoint(
        self, step: int, plan: Plan, recoveries: Sequence[dict[str, Any]], measurements: Sequence[Measurement], capacity: int | None,
        *, may_step: bool = True,
    ) -> dict[str, Any] | None:
        """Just after a checkpoint at ``step``: the step up to take now, as a recoveries record
        (``restart``: the attempt ends for a new process to take it). ``may_step``: False when
        the attempt has changed plans too often already (the boundary still counts)."""
        self.on_trial_from = None  # a plan stepped up to that reached this checkpoint has held
        if not may_step:
            return None
        return self._step_up(step, plan, recoveries, measurements, capacity)

    def after_oom(self, step: int, plan: Plan, oom: str) -> dict[str, Any] | None:
        """An OOM at ``step`` under ``plan``: when a step up is on trial, the way back to the plan
        it left (which worked), as a recoveries record; else None (the ordinary recovery)."""
        if self.on_trial_from is None:
            return None
        back, self.on_trial_from = self.on_trial_from, None
        wait = self.back_off.failed()
        return {
            "step": step, "from": plan.to_dict(), "to": back.to_dict(), "oom": oom, "direction": BACK, "restart": self.needs_restart(plan, back),
            "reason": f"the step back up did not hold: back to the plan that worked; the next try after {wait} checkpoint(s)",
        }

    def needs_restart(self, current: Plan, other: Plan) -> bool:
        return not self.in_process or not in_process_reach(current, other)

    def _step_up(
        self, step: int, plan: Plan, recoveries: Sequence[dict[str, Any]], measurements: Sequence[Measurement], capacity: int | None,
        *, at_start: bool = False,
    ) -> dict[str, Any] | None:
        if not self.back_off.ready():
            return None
        earlier = self.history
        above = [*(earlier.above if earlier else ()), *(Plan.from_dict(change["from"]) for change in recoveries if left_for_room(change))]
        if not at_start and earlier is not None and not earlier.restarts:
            above = [other for other in above if not self.needs_restart(plan, other)]  # none through a restart here
        known = [*(earlier.measurements if earlier else ()), *measurements]
        found = step_up(plan, above, known, capacity, origin=self.origin)
        if found is None:
            return None
        self.on_trial_from = plan
        restart = not at_start and self.needs_restart(plan, found.plan)  # at the start nothing is built yet
        return {
            "step": step, "from": plan.to_dict(), "to": found.plan.to_dict(), "direction": UP, "restart": restart,
            "reason": found.reason + (f"; a new process resumes from the checkpoint at step {step} under it" if restart else ""),
        }
