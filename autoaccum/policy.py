"""What the guard changes a plan to, and the record of each change. Pure functions of plans.

- after an OOM (or allocator thrashing): half the micro-batch, the accumulation steps it then
  takes; the global batch never changes. Where a grown micro-batch failed, back to the last size
  that worked rather than below it.
- after calm steps, guided by memory (``autoaccum.regrow``): the plan with the fewest micro-steps
  whose micro-batch is predicted to fit in what is free now, up to the initial micro-batch
  (:func:`fitting_plan`);
- after calm steps, blindly (``grow="double"``, or where no meter reads memory): at most double,
  never to a size that failed, and only where that saves micro-steps; then the smallest
  micro-batch with that many steps (the lowest peak) (:func:`grown_plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from autoaccum.plan import Plan, micro_step_count

__all__ = ["PlanChange", "Reason", "fitting_plan", "grown_plan", "shrunk_plan"]

Reason = Literal["oom", "thrash", "grow"]


@dataclass(frozen=True)
class PlanChange:
    """One change of plan: why, at which optimizer step, and where the OOM struck (for a growth: what
    guided it, empty for blind doubling; for thrashing across ranks: which ranks said so)."""

    step: int
    reason: Reason
    where: str
    old: Plan
    new: Plan

    def describe(self) -> str:
        grow = f"no OOM for a while ({self.where}):" if self.where else "no OOM for a while:"
        thrash = f"allocator thrashing ({self.where}) at" if self.where else "allocator thrashing at"
        what = {"oom": f"OOM in {self.where} at", "thrash": thrash, "grow": grow}
        if self.old.tokens is not None and self.new.tokens is not None:
            return (f"{what[self.reason]} a budget of {self.old.tokens.max_cost:,.0f} -> {self.new.tokens.max_cost:,.0f} "
                    f"token-units per micro-batch (micro <= {self.old.micro_batch} -> {self.new.micro_batch}), "
                    f"global batch {self.new.target_batch} unchanged")
        return (f"{what[self.reason]} micro {self.old.micro_batch} -> {self.new.micro_batch}, accum "
                f"{self.old.accum_steps} -> {self.new.accum_steps}, global batch {self.new.target_batch} unchanged")


def shrunk_plan(plan: Plan, floor: int | None = None) -> Plan:
    """The plan after an OOM: half the micro-batch; or ``floor`` (the micro-batch of the last step
    that succeeded) where halving a grown micro-batch would go below it.

    Raises:
        ValueError: the micro-batch is the model's smallest already.
    """
    new = plan.halved()
    if floor is not None and new.micro_batch < floor < plan.micro_batch:
        return plan.with_micro_batch(floor)
    return new


def grown_plan(plan: Plan, initial_micro_batch: int, ceiling: int | None) -> Plan | None:
    """The plan after calm steps, or None where growing saves no micro-step.

    Args:
        plan: the plan in force.
        initial_micro_batch: the micro-batch the run started with (never grown past).
        ceiling: the smallest micro-batch that failed (never grown to), None if none did.
    """
    limit = initial_micro_batch if ceiling is None else min(initial_micro_batch, ceiling - 1)
    # plans are balanced: that many passes with the smallest micro-batch that makes them, the lowest peak
    bigger = plan.with_micro_batch(max(plan.min_micro_batch, min(plan.micro_batch * 2, limit)))
    if bigger.accum_steps >= plan.accum_steps:
        return None  # a bigger micro-batch with as many passes costs memory and gains nothing
    return bigger


def fitting_plan(plan: Plan, largest: int, fits: Callable[[int], bool]) -> Plan | None:
    """The plan with the fewest micro-steps whose micro-batch is at most ``largest`` and ``fits``;
    None where no plan that fits saves a micro-step.

    Each number of micro-steps is tried with the smallest micro-batch that makes it (plans are
    balanced: ``target 256`` in 2 steps is ``128 x 2``, not ``200 + 56``), fewest steps first, so
    the first that fits is the largest that fits. The target, the ranks and the smallest
    micro-batch stay the plan's.
    """
    share = plan.rank_batch(0)
    tried: set[int] = set()
    for steps in range(micro_step_count(share, max(1, min(largest, share))), plan.accum_steps):
        candidate = plan.with_micro_batch(max(plan.min_micro_batch, -(-share // steps)))
        if candidate.micro_batch in tried or candidate.accum_steps >= plan.accum_steps:
            continue
        tried.add(candidate.micro_batch)
        if candidate.micro_batch <= largest and fits(candidate.micro_batch):
            return candidate
    return None
