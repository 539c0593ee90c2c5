"""Growth after an OOM, as pure rules: what a step at a size is predicted to need, and whether it fits.

The guard's policy (``autoaccum.guard.policy``) halves the micro-batch on an OOM and, after calm steps,
grows back. Memory-guided growth (``grow="model"``, and ``"auto"`` where the meter knows its limit) rests
on what clean steps took per size above the bytes live at their start (``Rise``) and on the growths that
ran out of memory (``FailedGrowth``), both measured from the meter's reading at the step's start
(``StepStart``). Blind growth (``grow="double"``) doubles; ``"auto"`` does not grow where no meter
knows the limit.

The rules (``fits``): a size does not fit where a growth to it or to a smaller size failed with no
less room than there is now; it fits where it ran clean with no more room than now; otherwise its
predicted rise must stay within the usable part of the limit. The predicted rise of a size not run
(``predicted_rise``) is the largest of: the line through the sizes run (the rises failed growths
reached count as lower bounds), the nearest smaller size plus the probe model's bytes per sample,
and -- with nothing else to go by, or once a growth past that size failed -- that size's rise
scaled in proportion.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from autoaccum.memory import MemoryReading, Meter, usable_bytes
from autoaccum.memory.model import MemoryModel, MemoryPoint
from autoaccum.plan.plan import Plan, micro_step_count
from autoaccum.validate import check_choice, check_headroom, check_positive_int

__all__ = ["DEFAULT_GROW_AFTER", "DEFAULT_HEADROOM", "FailedGrowth", "GrowMode", "Rise", "StepStart",
           "check_growth_meter", "check_growth_options", "fits", "fitting_plan", "memory_limit", "predicted_rise",
           "prior_of"]


@dataclass(frozen=True)
class Rise:
    """What clean steps at one micro-batch size took, above the bytes live at their start.

    Attributes:
        micro_batch: the plan's micro-batch (its largest cut).
        fwd_bwd_bytes: the peak of the forward/backward passes above the start (the largest seen).
        step_bytes: the peak of the whole step above the start, optimizer step included (the largest seen).
        free_bytes: the limit minus the live bytes at the start (the least any clean step ran with).
    """

    micro_batch: int
    fwd_bwd_bytes: int
    step_bytes: int
    free_bytes: int

    def merged(self, other: Rise) -> Rise:
        """The record of both: the larger rises, the smaller room."""
        return Rise(self.micro_batch, max(self.fwd_bwd_bytes, other.fwd_bwd_bytes),
                    max(self.step_bytes, other.step_bytes), min(self.free_bytes, other.free_bytes))


@dataclass(frozen=True)
class FailedGrowth:
    """A grown (or thrashing) micro-batch that ran out of memory, and the room it had.

    Attributes:
        micro_batch: the size that failed.
        free_bytes: the limit minus the live bytes at the start of the step it failed in.
        short_bytes: what the failed allocation lacked beyond the limit (0 where the meter cannot say).
        reached_bytes: how far the failed attempt rose above its start (a lower bound on its rise).
    """

    micro_batch: int
    free_bytes: int
    short_bytes: int = 0
    reached_bytes: int = 0

    def blocks(self, micro_batch: int, free_bytes: int) -> bool:
        """True while ``micro_batch`` is this size or larger and no more is free than then needed."""
        return micro_batch >= self.micro_batch and free_bytes <= self.free_bytes + self.short_bytes


def memory_limit(meter: Meter) -> int | None:
    """The most bytes ``meter`` may count live before an allocation fails, now; None where unknown.

    An emulated budget's size; on CUDA what this process can reach (free + its allocator's cache,
    within the per-process fraction, and within the meter's own budget where it was given one);
    else the meter's ``budget_bytes`` (None for ``NullMeter``)."""
    if meter.kind == "cuda":
        from autoaccum.memory import cuda_available_bytes

        return min(cuda_available_bytes(meter.device), int(meter.budget_bytes))  # type: ignore[attr-defined]
    budget = meter.budget_bytes
    return None if budget is None else int(budget)


def _optimizer_rise(rise: Rise) -> int:
    """The optimizer step's rise where it set the step's peak; else 0 (then it is below the
    forward/backward peak of this size and of every larger one, and never decides a prediction)."""
    return rise.step_bytes if rise.step_bytes > rise.fwd_bwd_bytes else 0


def predicted_rise(micro_batch: int, rises: Mapping[int, Rise], prior: MemoryModel | None = None,
                   failures: Iterable[FailedGrowth] = ()) -> int | None:
    """How far a step at ``micro_batch`` is predicted to rise above the bytes live at its start (the
    rules of the module docstring); None where nothing can be estimated."""
    failures = tuple(failures)
    reached = max((f.reached_bytes for f in failures if f.micro_batch <= micro_batch), default=0)
    if micro_batch in rises:
        return max(rises[micro_batch].step_bytes, reached)
    below = [r for b, r in rises.items() if b < micro_batch]
    opt = max((_optimizer_rise(r) for r in rises.values()), default=0)
    estimates = []
    # the line through the measured sizes, and through the bytes failed growths reached (lower bounds)
    points = [MemoryPoint(r.micro_batch, r.fwd_bwd_bytes, _optimizer_rise(r)) for r in rises.values()]
    points += [MemoryPoint(f.micro_batch, f.reached_bytes, 0) for f in failures
               if f.reached_bytes > 0 and f.micro_batch not in rises]
    if rises and len({p.micro_batch for p in points}) >= 2:
        estimates.append(MemoryModel.fit(points).predict(micro_batch))
    anchor = max(below, key=lambda r: r.micro_batch) if below else None
    if anchor is not None and prior is not None:
        slope = max(prior.per_sample_bytes, 0.0)
        estimates.append(max(opt, int(anchor.fwd_bwd_bytes + slope * (micro_batch - anchor.micro_batch) + 0.5)))
    # the upper bound: with nothing else to go by, or where a growth past the anchor failed (the
    # estimates let it be tried: they are not trusted above the anchor until memory frees up)
    if anchor is not None and ((len(rises) == 1 and prior is None) or
                               any(f.micro_batch > anchor.micro_batch for f in failures)):
        estimates.append(-(-anchor.step_bytes * micro_batch // anchor.micro_batch))
    return max(*estimates, reached) if estimates else None


def fits(micro_batch: int, *, live_bytes: int, limit_bytes: int, headroom: float, rises: Mapping[int, Rise],
         prior: MemoryModel | None = None, failures: Iterable[FailedGrowth] = ()) -> bool:
    """Whether a step at ``micro_batch`` is predicted to fit, with ``live_bytes`` live now under a
    limit of ``limit_bytes`` (the rules of the module docstring)."""
    failures = tuple(failures)
    free = limit_bytes - live_bytes
    if any(f.blocks(micro_batch, free) for f in failures):
        return False
    measured = rises.get(micro_batch)
    if measured is not None and free >= measured.free_bytes:
        return True
    rise = predicted_rise(micro_batch, rises, prior, failures)
    return rise is not None and live_bytes + rise <= usable_bytes(limit_bytes, headroom)



#: how the guard grows the micro-batch back after calm steps (see ``OOMGuard``)
GrowMode = Literal["auto", "model", "double", "off"]
#: calm steps (no OOM since the last plan change) before growing back
DEFAULT_GROW_AFTER = 2
#: the fraction of the limit a predicted size keeps free, where neither ``headroom`` nor a probe report gives one
DEFAULT_HEADROOM = 0.1


def check_growth_options(grow: object, grow_after: object, memory_model: object = None) -> None:
    """``grow``, ``grow_after`` and ``memory_model`` as the guard takes them (and ``fit`` and the
    integrations, which hand them on): ValueError/TypeError naming the value and the allowed range."""
    check_choice(grow, "grow", get_args(GrowMode))
    check_positive_int(grow_after, "grow_after", hint=" (calm steps before growing back)")
    if memory_model is not None and not isinstance(memory_model, MemoryModel):
        raise TypeError(f"memory_model must be an autoaccum.MemoryModel (a probe report's .model), got "
                        f"{type(memory_model).__name__}")


def prior_of(plan: object, memory_model: MemoryModel | None,
             headroom: float | None) -> tuple[MemoryModel | None, float]:
    """The memory model and headroom growth uses: those given, else a probe report's (``plan``), else
    no model and ``DEFAULT_HEADROOM``."""
    report_model = getattr(plan, "model", None)
    model = memory_model if memory_model is not None else (
        report_model if isinstance(report_model, MemoryModel) else None)
    report_headroom = getattr(plan, "headroom", None) if isinstance(report_model, MemoryModel) else None
    return model, check_headroom(headroom if headroom is not None else
                                 report_headroom if report_headroom is not None else DEFAULT_HEADROOM)


@dataclass(frozen=True)
class StepStart:
    """The meter at a step's start, which what the step took is measured from.

    Attributes:
        reading: the meter's reading (its peak reset), None where it reads nothing.
        limit: the meter's limit, read only for memory-guided growth (CUDA: two allocator queries).
        ooms: the emulated budget's OOM count (to tell its own OOM from another).
        full_step: the step holds this rank's whole share (a partial one measures nothing).
    """

    reading: MemoryReading | None
    limit: int | None
    ooms: int
    full_step: bool

    @classmethod
    def read(cls, meter: Meter, *, full_step: bool, read_limit: bool) -> StepStart:
        meter.reset_peak()
        reading = meter.read()
        limit = memory_limit(meter) if reading is not None and read_limit else None
        return cls(reading, limit, getattr(meter, "oom_count", 0), full_step)

    def after_passes(self, meter: Meter) -> MemoryReading | None:
        """The meter after the forward/backward passes (only where growth is guided by memory)."""
        return meter.read() if self.limit is not None else None

    def rise(self, micro_batch: int, fwd_bwd: MemoryReading | None, end: MemoryReading | None) -> Rise | None:
        """What a clean step at ``micro_batch`` took above its start, and the room it had (None: not measured)."""
        start = self.reading
        if self.limit is None or not self.full_step or start is None or end is None or fwd_bwd is None:
            return None
        fwd_bwd_rise = fwd_bwd.peak_bytes - start.current_bytes
        # what the step left live (the optimizer state its first step creates) is in the next step's
        # start, not in its rise
        kept = max(0, end.current_bytes - start.current_bytes)
        return Rise(micro_batch, fwd_bwd_rise, max(fwd_bwd_rise, end.peak_bytes - start.current_bytes - kept),
                    self.limit - start.current_bytes)

    def failure(self, meter: Meter, micro_batch: int) -> FailedGrowth | None:
        """A grown step at ``micro_batch`` ran out of memory here: the room it had and how far it got."""
        start, limit_bytes = self.reading, self.limit
        if limit_bytes is None or start is None:
            return None
        now = meter.read()
        reached = 0 if now is None else now.peak_bytes - start.current_bytes
        needed = meter.last_oom_needed_bytes
        short = 0
        if needed is not None and getattr(meter, "oom_count", 0) > self.ooms:  # the budget's own OOM
            short, reached = max(needed - limit_bytes, 0), max(reached, needed - start.current_bytes)
        return FailedGrowth(micro_batch, limit_bytes - start.current_bytes, short, max(reached, 0))

    def room(self, micro_batch: int) -> FailedGrowth | None:
        """The room a thrashing step at ``micro_batch`` had: not grown back to soon."""
        if self.limit is None or self.reading is None:
            return None
        return FailedGrowth(micro_batch, self.limit - self.reading.current_bytes)


def check_growth_meter(grow: GrowMode, meter: Meter) -> None:
    """``grow="model"`` needs a meter that reads memory and knows its limit."""
    if grow == "model" and (meter.read() is None or memory_limit(meter) is None):
        raise ValueError(f"grow='model' needs a meter that reads memory and knows its limit: CUDA, or an emulated "
                         f"budget (meter=autoaccum.TrackedMemory(budget_bytes=...)); this guard's meter is "
                         f"{type(meter).__name__} ({meter.kind}). Use grow='double' or 'off' here.")


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
