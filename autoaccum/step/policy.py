"""How the guard's plan changes, and the record of each change (``PlanPolicy``), every change agreed
across ranks:

- after an OOM (or allocator thrashing): half the micro-batch, the accumulation steps it then
  takes; the global batch never changes. Where a grown micro-batch failed, back to the last size
  that worked rather than below it.
- after calm steps, guided by memory (``autoaccum.step.growth``): the plan with the fewest micro-steps
  whose micro-batch is predicted to fit in what is free now, up to the initial micro-batch
  (``autoaccum.step.growth.fitting_plan``);
- after calm steps, blindly (``grow="double"``, or where no meter reads memory): at most double,
  never to a size that failed, and only where that saves micro-steps; then the smallest
  micro-batch with that many steps (the lowest peak) (``grown_plan``);
- after an OOM at the smallest micro-batch: the next rung of the memory ladder
  (``autoaccum.memory.savers``), and after many calm steps at the smallest micro-batch back down a
  rung (waiting twice as long after each step down that ran out of memory).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from autoaccum.log import rank_level
from autoaccum.memory import MemoryReading, Meter
from autoaccum.memory.savers import Rung, next_rung, rung_index
from autoaccum.plan.batchnorm import warn_batchnorm
from autoaccum.plan.plan import Plan
from autoaccum.step.growth import Growth
from autoaccum.step.sync import GradSync

__all__ = ["PlanChange", "PlanPolicy", "Reason", "ThrashWatch", "grown_plan", "shrunk_plan"]

Reason = Literal["oom", "thrash", "grow"]
#: calm steps at the smallest micro-batch before stepping a rung down, in units of ``grow_after``
STEP_DOWN_AFTER = 4

#: plan changes are the guard's messages (rank 0 warns; the others log at debug level)
logger = logging.getLogger("autoaccum.step.guard")


@dataclass(frozen=True)
class PlanChange:
    """One change of plan.

    Attributes:
        step: the optimizer step (1-based) during or after which the plan changed.
        reason: ``oom``, ``thrash`` (allocator retries rising) or ``grow``.
        where: for an OOM, the phase it struck in (or ``another rank``); for a growth, what guided it
            (empty for blind doubling); for thrashing across ranks, which ranks said so.
        old: the plan before the change.
        new: the plan after it.
    """

    step: int
    reason: Reason
    where: str
    old: Plan
    new: Plan

    def describe(self) -> str:
        """The change in a user's words, each cut written so that it adds up (``Plan.describe``):
        ``OOM in backward: batch 256 = 64 x 4 -> 32 x 8 (8 micro-batches); the global batch is unchanged``."""
        where = f" ({self.where})" if self.where else ""
        what = {"oom": f"OOM in {self.where}", "thrash": f"allocator retries rising{where}",
                "grow": f"no OOM for a while{where}"}[self.reason]
        old, new = self.old, self.new
        rung = f", memory saver {old.saver} -> {new.saver}" if old.saver != new.saver else ""
        if old.tokens is not None and new.tokens is not None:
            cut = new.length_words() if old.length_words() == new.length_words() else \
                f"{old.length_words().split(';')[0]} -> {new.length_words()}"
            return f"{what}: batch {new.target_batch} cut by length: {cut}{rung}; the global batch is unchanged"
        before, after = old.cut_sum(), new.cut_sum()
        cut = after if before == after else f"{before} -> {after}"
        return (f"{what}: batch {new.target_batch} = {cut} ({new.count_words()}){rung}; the global batch is "
                f"unchanged")


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


class ThrashWatch:
    """Allocator retries rising on consecutive clean steps (CUDA): the cue to shrink."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.streak = 0
        self.last_retries: int | None = None
        #: across ranks: this rank's streak reached ``steps``; said in the next step's exchange
        self.pending = False

    def reached(self, reading: MemoryReading | None, attempts: int, can_shrink: bool) -> bool:
        """After a successful step: the streak reached ``steps`` (and is reset)."""
        if reading is None or reading.alloc_retries is None:
            return False
        # a step that replayed after an OOM retried by definition: that OOM was acted on already
        rising = self.last_retries is not None and reading.alloc_retries > self.last_retries and attempts == 1
        self.last_retries = reading.alloc_retries
        self.streak = self.streak + 1 if rising else 0
        if self.streak >= self.steps and can_shrink:
            self.streak = 0
            return True
        return False


class PlanPolicy:
    """The guard's plan and its changes: halve on an OOM (never below the smallest micro-batch, and
    back to the last size that worked where a grown one failed), shrink on allocator thrashing, grow
    back after calm steps; each change agreed across ranks (``sync.agree_plan``), logged and recorded.

    Attributes:
        plan: the plan in force.
        initial_micro_batch: the micro-batch the run started with (never grown past).
        ceiling: the smallest micro-batch that failed.
        floor: the micro-batch of the last step that succeeded.
        ooms: OOMs recovered.
        failed_growths: growths that ran out of memory (each also in ``ooms``).
        changes: every change so far.
    """

    def __init__(self, plan: Plan, sync: GradSync, growth: Growth, thrash_steps: int, *, log_changes: bool,
                 model: torch.nn.Module, ladder: tuple[Rung, ...] = ("none",)) -> None:
        self.plan, self.sync, self.growth, self.ladder = plan, sync, growth, ladder
        #: each rung the smallest micro-batch ran out of memory on, with the bytes it needed
        self.rungs_tried: list[tuple[str, int | None]] = []
        self._down_after = STEP_DOWN_AFTER * growth.calm_needed  # calm steps before a step down
        self._stepped_down = False  # the last change stepped a rung down, and no step has run clean since
        self.thrash = ThrashWatch(thrash_steps)
        self.log_changes = log_changes
        self._model = model  # for the BatchNorm warning, said once where a micro-batch is small
        self._warned_batchnorm = False
        self.warn_batchnorm()
        self.initial_micro_batch = plan.micro_batch
        self.ceiling: int | None = None
        self.floor: int | None = None
        self.ooms = 0
        self.failed_growths = 0
        self.changes: list[PlanChange] = []

    def shrink(self, reason: Reason, where: str, step: int, does_not_fit: Callable[[], Exception],
               needed_bytes: int | None = None) -> PlanChange:
        """Half the micro-batch (after an OOM or thrashing); at the smallest, the next rung of the
        memory ladder; at its top, ``does_not_fit()`` is raised (``needed_bytes``: what the OOM asked)."""
        old = self.plan
        self.ooms += reason == "oom"
        if not old.can_shrink:
            self.rungs_tried.append((old.saver, needed_bytes))
            higher = next_rung(self.ladder, old.saver)
            if higher is None:
                raise does_not_fit()
            if self._stepped_down:  # the lighter rung did not fit after all: wait twice as long next time
                self._down_after *= 2
            self._stepped_down = False
            self.plan = self.sync.agree_plan(old.with_saver(higher))
            self.growth = self.growth.fresh()  # what steps took on the other rung says nothing here
            return self._record(reason, where, old, step)
        self.ceiling = old.micro_batch if self.ceiling is None else min(self.ceiling, old.micro_batch)
        self.plan = self.sync.agree_plan(shrunk_plan(old, self.floor))
        self.growth.grown = False
        return self._record(reason, where, old, step)

    def failed_attempt(self, meter: Meter, *, local: bool) -> None:
        """An attempt ran out of memory: where it was a growth's first step, counted and remembered
        against the room it had (``local``: the OOM struck on this rank)."""
        if self.growth.grown:
            self.failed_growths += 1
            self.growth.failed(meter, self.plan.micro_batch, local=local)

    def grow_to_fit(self, step: int) -> list[PlanChange]:
        """At a step's start, after calm steps: the plan with the fewest micro-steps predicted to fit
        in what is free now; the smallest any rank proposes wins. Whether to ask depends only on what
        every rank shares (the agreed plan, the calm steps), so every rank joins the exchange."""
        if not self.growth.may_grow(self.plan, self.initial_micro_batch):
            return []
        old = self.plan
        proposal = self.growth.fitting(old, self.initial_micro_batch)
        self.plan = self.sync.agree_plan(proposal if proposal is not None else old)
        if self.plan.micro_batch == old.micro_batch:
            return []  # nothing fits yet: the calm steps go on counting, and the next step asks again
        self.growth.grown = True
        return [self._record("grow", "predicted to fit in the free memory", old, step)]

    def after_step(self, attempts: int, reading: MemoryReading | None, thrashing: tuple[int, ...], step: int,
                   does_not_fit: Callable[[], Exception]) -> list[PlanChange]:
        """After a successful step: shrink on allocator thrashing, or grow blindly after calm steps.

        ``thrashing``: the ranks that said, in this step's exchange, that their allocator thrashed
        (the same on every rank, so is everything decided from it)."""
        self.floor = self.plan.micro_batch
        if attempts == 1:
            self.growth.measured(self.plan.micro_batch, reading)
            self._stepped_down = False
        if self.thrash.reached(reading, attempts, self.plan.can_shrink):
            if self.sync.world_size == 1:
                self.growth.thrashed(self.plan.micro_batch)  # memory-guided growth: not back to it soon
                return [self.shrink("thrash", "", step, does_not_fit)]
            # Across ranks a shrink is agreed (a collective), and this streak is this rank's alone: it
            # is said in the next step's exchange, and acted on below by every rank after that step.
            self.thrash.pending = True
        if thrashing:
            self.thrash.pending, self.thrash.streak = False, 0  # said and heard: a new streak from here
            if attempts == 1 and self.plan.can_shrink:  # a replayed step shrank for its OOM already
                self.growth.thrashed(self.plan.micro_batch)
                ranks = ", ".join(str(r) for r in thrashing)
                where = f"on rank{'s' if len(thrashing) > 1 else ''} {ranks}"
                return [self.shrink("thrash", where, step, does_not_fit)]
        self.growth.count_calm(attempts)
        if self.plan.saver != "none" and not self.plan.can_shrink and self.growth.calm >= self._down_after:
            return self._step_down(step)
        if not self.growth.doubles or self.growth.calm < self.growth.calm_needed:
            return []
        self.growth.calm = 0
        old = self.plan
        bigger = grown_plan(old, self.initial_micro_batch, self.ceiling)
        if bigger is None:
            return []
        self.plan = self.sync.agree_plan(bigger)
        return [self._record("grow", "", old, step)] if self.plan.micro_batch != old.micro_batch else []

    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "initial_micro_batch": self.initial_micro_batch,
                "ceiling": self.ceiling, "floor": self.floor, "ooms": self.ooms, "failed_growths": self.failed_growths}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        plan = Plan.from_dict(state["plan"])
        if plan.target_batch != self.plan.target_batch:
            raise ValueError(f"the saved guard state is for target_batch {plan.target_batch}, this guard's is "
                             f"{self.plan.target_batch}")
        self.plan = plan.with_world_size(self.sync.world_size)
        self.initial_micro_batch = int(state["initial_micro_batch"])
        self.ceiling = None if state["ceiling"] is None else int(state["ceiling"])
        self.floor = None if state.get("floor") is None else int(state["floor"])
        self.ooms, self.failed_growths = int(state["ooms"]), int(state.get("failed_growths", 0))
        self.thrash = ThrashWatch(self.thrash.steps)  # no thrash carries over (every rank loads alike)
        self.warn_batchnorm()

    def _step_down(self, step: int) -> list[PlanChange]:
        """Calm steps at the smallest micro-batch on a rung above none: one rung down (the memory taken
        by another process may have come back); an OOM there climbs again."""
        lower = [r for r in self.ladder if rung_index(r) < rung_index(self.plan.saver)]
        if not lower:
            return []
        old, calm = self.plan, self.growth.calm
        self.plan = self.sync.agree_plan(old.with_saver(lower[-1]))
        if self.plan.saver == old.saver:
            return []
        self._stepped_down = True
        self.growth = self.growth.fresh()
        return [self._record("grow", f"{calm} calm steps at the smallest micro-batch", old, step)]

    def _record(self, reason: Reason, where: str, old: Plan, step: int) -> PlanChange:
        change = PlanChange(step, reason, where, old, self.plan)
        self.changes.append(change)
        if self.log_changes:
            logger.log(rank_level(logging.WARNING, self.sync.rank), change.describe())  # agreed: rank 0 says it
        self.growth.calm = 0
        self.warn_batchnorm()
        return change

    def warn_batchnorm(self) -> None:
        """BatchNorm normalises each micro-batch on its own: said once (``autoaccum.plan.batchnorm``)."""
        if not self._warned_batchnorm:
            self._warned_batchnorm = warn_batchnorm(self._model, self.plan)
