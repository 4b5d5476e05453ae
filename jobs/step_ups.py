"""The runner's side of stepping back up (strategies/step_up.py): at each checkpoint boundary,
the plan to go back up to, if any; and after an OOM while such a step is on trial (it has not
reached a checkpoint yet), the way back to the plan that worked, with the back-off doubled.

Each change is a record of the attempt's ``recoveries`` (what the heartbeat and outcome.json
carry, and the daemon reports as events), with a ``direction``: "up" for a step up, "back" for
its failure. The plans a process may step up to are the ones it stepped down from: every
record's "from" but a step up's (the probe's first plan included: a neighbour that was there
when the job started may leave)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.plan import Plan
from oomguard.strategies.step_up import BackOff, step_up

UP = "up"
BACK = "back"


class StepUps:
    def __init__(self) -> None:
        self.back_off = BackOff()
        # The plan a step up left, while the plan it went to has not reached a checkpoint.
        self.on_trial_from: Plan | None = None

    def at_checkpoint(
        self, step: int, plan: Plan, recoveries: Sequence[dict[str, Any]], measurements: Sequence[Measurement], capacity: int | None,
    ) -> dict[str, Any] | None:
        """Just after a checkpoint at ``step``: the step up to take now, as a recoveries record."""
        self.on_trial_from = None  # a plan stepped up to that reached this checkpoint has held
        if not self.back_off.ready():
            return None
        above = [Plan.from_dict(change["from"]) for change in recoveries if change.get("direction") != UP]
        found = step_up(plan, above, measurements, capacity)
        if found is None:
            return None
        self.on_trial_from = plan
        return {"step": step, "from": plan.to_dict(), "to": found.plan.to_dict(), "reason": found.reason, "direction": UP}

    def after_oom(self, step: int, plan: Plan, oom: str) -> dict[str, Any] | None:
        """An OOM at ``step`` under ``plan``: when a step up is on trial, the way back to the plan
        it left (which worked), as a recoveries record; else None (the ordinary recovery)."""
        if self.on_trial_from is None:
            return None
        back, self.on_trial_from = self.on_trial_from, None
        wait = self.back_off.failed()
        return {
            "step": step, "from": plan.to_dict(), "to": back.to_dict(), "oom": oom, "direction": BACK,
            "reason": f"the step back up did not hold: back to the plan that worked; the next try after {wait} checkpoint(s)",
        }
