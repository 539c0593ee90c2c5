"""How the guard's plan changes (``PlanPolicy``), every change agreed across ranks and recorded:

- **shrink**, after an OOM (or allocator thrashing): half the micro-batch, the accumulation steps it
  then takes; the global batch never changes. Where a grown micro-batch failed, back to the last size
  that worked rather than below it. At the smallest micro-batch, the next memory saver
  (``autoaccum.memory.savers``); past the last one, ``DoesNotFitError``.
- **grow back**, after calm steps: guided by memory (``grow="model"``), the plan with the fewest
  micro-steps whose micro-batch is predicted to fit in what is free now, up to the initial micro-batch
  (``autoaccum.guard.growth``; ``"auto"`` does this where the meter knows its limit, and does not grow
  elsewhere); blindly (``grow="double"``), at most double, never to a size that
  failed, and only where that saves micro-steps. After many calm steps at the smallest micro-batch
  on a memory saver, one saver back down (waiting twice as long after each step down that ran out of
  memory).
- **thrash**: on CUDA, allocator retries rising on ``thrash_steps`` clean steps in a row shrink as an
  OOM would. Across ranks one rank's streak is said in the next step's exchange and every rank shrinks
  after that step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from autoaccum.distributed.sync import GradSync
from autoaccum.guard.growth import FailedGrowth, GrowMode, Rise, StepStart, fits, fitting_plan
from autoaccum.log import rank_level
from autoaccum.memory import MemoryReading, Meter
from autoaccum.memory.model import MemoryModel
from autoaccum.memory.savers import describe_saver, next_saver, saver_rank
from autoaccum.plan.batchnorm import trains_batchnorm, warn_batchnorm
from autoaccum.plan.plan import Plan

__all__ = ["PlanChange", "PlanPolicy", "Reason", "grown_plan", "shrunk_plan"]

Reason = Literal["oom", "thrash", "grow"]
#: calm steps at the smallest micro-batch before stepping a memory saver down, in units of ``grow_after``
STEP_DOWN_AFTER = 4
#: what a memory-guided growth says it was guided by (its ``PlanChange.where``)
GUIDED = "predicted to fit in the free memory"

#: plan changes are the guard's messages (rank 0 warns; the others log at debug level)
logger = logging.getLogger("autoaccum.guard")


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
        saver = f", memory saver {describe_saver(old.saver)} -> {describe_saver(new.saver)}" \
            if old.saver != new.saver else ""
        if old.tokens is not None and new.tokens is not None:
            cut = new.length_words() if old.length_words() == new.length_words() else \
                f"{old.length_words().split(';')[0]} -> {new.length_words()}"
            return f"{what}: batch {new.target_batch} cut by length: {cut}{saver}; the global batch is unchanged"
        before, after = old.cut_sum(), new.cut_sum()
        cut = after if before == after else f"{before} -> {after}"
        return (f"{what}: batch {new.target_batch} = {cut} ({new.count_words()}){saver}; the global batch is "
                f"unchanged")

    @property
    def stepped_down(self) -> bool:
        """The change stepped a memory saver down (after calm steps at the smallest micro-batch)."""
        return saver_rank(self.new.saver) < saver_rank(self.old.saver)


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


class PlanPolicy:
    """The guard's plan and every change of it (see the module docstring); arguments as ``OOMGuard``'s,
    checked there.

    Attributes:
        plan: the plan in force.
        initial_micro_batch: the micro-batch the run started with (never grown past).
        ceiling: the smallest micro-batch that failed.
        floor: the micro-batch of the last step that succeeded.
        ooms: OOMs recovered.
        failed_growths: memory-guided growths that ran out of memory (each also in ``ooms``).
        changes: every change so far.
        savers_tried: each memory saver the smallest micro-batch ran out of memory on, with the bytes it needed.
        rises: what clean full steps took, per micro-batch size (memory-guided growth).
        failures: growths that ran out of memory (or thrashed), against the room they had.
        calm: clean steps since the last plan change.
    """

    def __init__(self, plan: Plan, sync: GradSync, *, model: torch.nn.Module, savers: tuple[str, ...],
                 grow: GrowMode, grow_after: int, memory_model: MemoryModel | None, headroom: float,
                 thrash_steps: int, log_changes: bool) -> None:
        self.plan, self.sync, self.savers, self._model = plan, sync, savers, model
        self.grow, self.grow_after, self.memory_model, self.headroom = grow, grow_after, memory_model, headroom
        self.thrash_steps, self.log_changes = thrash_steps, log_changes
        self.initial_micro_batch = plan.micro_batch
        self.ceiling: int | None = None
        self.floor: int | None = None
        self.ooms = 0
        self.failed_growths = 0
        self.changes: list[PlanChange] = []
        self.savers_tried: list[tuple[str, int | None]] = []
        self.rises: dict[int, Rise] = {}
        self.failures: list[FailedGrowth] = []
        self.calm = 0
        self._down_after = STEP_DOWN_AFTER * grow_after  # calm steps before a step down
        self._streak = 0  # clean steps in a row with the allocator's retries rising
        self._retries: int | None = None  # the allocator's retries after the last step
        warn_batchnorm(model, plan)

    # -- what the state says ------------------------------------------------------------------------------
    @property
    def guided(self) -> bool:
        """Memory-guided growth is asked for (where the meter knows its limit)."""
        return self.grow in ("auto", "model")

    @property
    def thrash_pending(self) -> bool:
        """This rank's thrash streak is complete: said in the next step's exchange (across ranks)."""
        return self._streak >= self.thrash_steps and self.plan.can_shrink

    def _last_change_was(self, test: Callable[[PlanChange], bool]) -> bool:
        """The last change passes ``test`` and no step has run clean since it."""
        return self.calm == 0 and bool(self.changes) and test(self.changes[-1])

    @property
    def grown(self) -> bool:
        """The plan in force was grown by memory and has not run a clean step yet."""
        return self._last_change_was(lambda c: c.reason == "grow" and c.where == GUIDED)

    # -- a step --------------------------------------------------------------------------------------------
    def begin(self, meter: Meter, *, full_step: bool, step: int) -> tuple[StepStart, list[PlanChange]]:
        """At a step's start: the meter's reading and, with memory-guided growth, the growth calm steps
        allow (``grow_to_fit``)."""
        start = StepStart.read(meter, full_step=full_step, read_limit=self.plan.tokens is None and self.guided)
        return start, self.grow_to_fit(start, step) if self.guided and start.limit is not None else []

    def grow_to_fit(self, start: StepStart, step: int) -> list[PlanChange]:
        """After calm steps: the plan with the fewest micro-steps predicted to fit in what is free now; the
        smallest any rank proposes wins. Whether to ask depends only on what every rank shares (the agreed
        plan, the calm steps), so every rank joins the exchange."""
        old = self.plan
        if self.calm < self.grow_after or old.micro_batch >= self.initial_micro_batch:
            return []
        if start.reading is None or start.limit is None:
            raise RuntimeError("internal: memory-guided growth needs the step's start and limit")
        live, limit = start.reading.current_bytes, start.limit
        proposal = fitting_plan(old, self.initial_micro_batch, lambda b: fits(
            b, live_bytes=live, limit_bytes=limit, headroom=self.headroom, rises=self.rises,
            prior=self.memory_model, failures=self.failures))
        self.plan = self.sync.agree_plan(proposal if proposal is not None else old)
        if self.plan.micro_batch == old.micro_batch:
            return []  # nothing fits yet: the calm steps go on counting, and the next step asks again
        return [self._record("grow", GUIDED, old, step)]

    def failed_attempt(self, meter: Meter, start: StepStart, *, local: bool) -> None:
        """An attempt ran out of memory: where it was a memory-guided growth's first step, counted and,
        where it struck on this rank, remembered against the room it had."""
        if not self.grown:
            return
        self.failed_growths += 1
        failure = start.failure(meter, self.plan.micro_batch) if local else None
        if failure is not None:
            self.failures.append(failure)

    def shrink(self, reason: Reason, where: str, step: int, does_not_fit: Callable[[], Exception],
               needed_bytes: int | None = None) -> PlanChange:
        """Half the micro-batch (after an OOM or thrashing); at the smallest, the next memory saver; past
        the last one, ``does_not_fit()`` is raised (``needed_bytes``: what the OOM asked)."""
        old = self.plan
        self.ooms += reason == "oom"
        higher = next_saver(self.savers, old.saver)
        if old.can_shrink and not (higher is not None and self._keeps_micro_batch()):
            self.ceiling = old.micro_batch if self.ceiling is None else min(self.ceiling, old.micro_batch)
            self.plan = self.sync.agree_plan(shrunk_plan(old, self.floor))
            return self._record(reason, where, old, step)
        self.savers_tried.append((old.saver, needed_bytes))
        if higher is None:
            raise does_not_fit()
        if old.can_shrink:  # BatchNorm: the next saver before a smaller micro-batch
            logger.log(rank_level(logging.WARNING, self.sync.rank) if self.log_changes else logging.DEBUG,
                       "BatchNorm layers in training mode: their statistics depend on the micro-batch, so the guard "
                       "takes the next memory saver (%s) before it halves micro-batch %d", describe_saver(higher),
                       old.micro_batch)
        if self._last_change_was(lambda c: c.stepped_down):  # the lighter saver did not fit: wait twice as long
            self._down_after *= 2
        self.plan = self.sync.agree_plan(old.with_saver(higher))
        self._forget_memory()  # what steps took with the other saver says nothing here
        return self._record(reason, where, old, step)

    def after_step(self, attempts: int, start: StepStart, fwd_bwd: MemoryReading | None, end: MemoryReading | None,
                   thrashing: tuple[int, ...], step: int, does_not_fit: Callable[[], Exception]) -> list[PlanChange]:
        """After a successful step: what it took, then a shrink on allocator thrashing, a step down, or a
        blind growth after calm steps.

        ``thrashing``: the ranks that said, in this step's exchange, that their allocator thrashed (the same
        on every rank, so is everything decided from it)."""
        self.floor = self.plan.micro_batch
        clean = attempts == 1
        if clean:
            rise = start.rise(self.plan.micro_batch, fwd_bwd, end)
            if rise is not None:
                old = self.rises.get(rise.micro_batch)
                self.rises[rise.micro_batch] = rise if old is None else old.merged(rise)
                # a size at least this large failed earlier, with no more room than this: that record is stale
                self.failures = [f for f in self.failures
                                 if f.micro_batch > rise.micro_batch or f.free_bytes > rise.free_bytes]
        self._count_retries(end, clean)
        if self.sync.world_size == 1 and self.thrash_pending:
            return [self._thrash(start, "", step, does_not_fit)]
        if thrashing:  # across ranks: said in this step's exchange and heard by every rank
            self._streak = 0
            if clean and self.plan.can_shrink:  # a replayed step shrank for its OOM already
                ranks = ", ".join(str(r) for r in thrashing)
                return [self._thrash(start, f"on rank{'s' if len(thrashing) > 1 else ''} {ranks}", step,
                                     does_not_fit)]
        self.calm = self.calm + 1 if clean else 0
        if self.plan.saver != "none" and (not self.plan.can_shrink or self._keeps_micro_batch()) \
                and self.calm >= self._down_after:
            return self._step_down(step)
        if not self._doubles() or self.calm < self.grow_after:
            return []
        self.calm = 0
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
        splits_before = _splits(self.plan)
        self.plan = plan.with_world_size(self.sync.world_size)
        self.initial_micro_batch = int(state["initial_micro_batch"])
        self.ceiling = None if state["ceiling"] is None else int(state["ceiling"])
        self.floor = None if state["floor"] is None else int(state["floor"])
        self.ooms, self.failed_growths = int(state["ooms"]), int(state["failed_growths"])
        self._streak, self._retries = 0, None  # no thrash carries over (every rank loads alike)
        if not splits_before:
            warn_batchnorm(self._model, self.plan)

    # -- the parts -------------------------------------------------------------------------------------------
    def _doubles(self) -> bool:
        """Blind growth, asked for (``"auto"`` grows only where memory guides it)."""
        return self.grow == "double"

    def _count_retries(self, end: MemoryReading | None, clean: bool) -> None:
        """The thrash streak: clean steps in a row whose allocator retries rose (a step that replayed
        after an OOM retried by definition: that OOM was acted on already)."""
        if end is None or end.alloc_retries is None:
            return
        rising = self._retries is not None and end.alloc_retries > self._retries and clean
        self._retries = end.alloc_retries
        self._streak = self._streak + 1 if rising else 0

    def _thrash(self, start: StepStart, where: str, step: int, does_not_fit: Callable[[], Exception]) -> PlanChange:
        """Shrink for allocator thrashing; with memory-guided growth, not back to that size soon."""
        self._streak = 0
        room = start.room(self.plan.micro_batch)
        if room is not None:
            self.failures.append(room)
        return self.shrink("thrash", where, step, does_not_fit)

    def _step_down(self, step: int) -> list[PlanChange]:
        """Calm steps at the smallest micro-batch on a memory saver: one saver down (the memory taken by
        another process may have come back); an OOM there turns to the next saver again."""
        lower = [s for s in self.savers if saver_rank(s) < saver_rank(self.plan.saver)]
        if not lower:
            return []
        old, calm = self.plan, self.calm
        self.plan = self.sync.agree_plan(old.with_saver(lower[-1]))
        if self.plan.saver == old.saver:
            return []
        self._forget_memory()
        return [self._record("grow", f"{calm} calm steps at the smallest micro-batch", old, step)]

    def _keeps_micro_batch(self) -> bool:
        """A BatchNorm layer trains: a smaller micro-batch changes its statistics and a memory saver does not,
        so the savers come first and a step down is tried after calm steps at any micro-batch."""
        return trains_batchnorm(self._model)

    def _forget_memory(self) -> None:
        """Another memory saver: what steps took, and the probe's memory model, were measured without it."""
        self.rises, self.failures, self.memory_model = {}, [], None

    def _record(self, reason: Reason, where: str, old: Plan, step: int) -> PlanChange:
        change = PlanChange(step, reason, where, old, self.plan)
        self.changes.append(change)
        if self.log_changes:
            logger.log(rank_level(logging.WARNING, self.sync.rank), change.describe())  # agreed: rank 0 says it
        self.calm = 0
        if not _splits(old):  # BatchNorm normalises each micro-batch on its own: said where the batch splits
            warn_batchnorm(self._model, self.plan)
        return change


def _splits(plan: Plan) -> bool:
    """The plan cuts the global batch (more than one micro-batch, or more than one rank)."""
    return plan.accum_steps > 1 or plan.world_size > 1

