"""Growth after an OOM: the guard's record of what its steps took, and when to grow back.

The guard halves the micro-batch on an OOM (``autoaccum.step.policy``); ``Growth`` decides when and
how far it grows back. It keeps what clean steps took per size above the bytes live at their start
(``Rise``), the growths that ran out of memory (``FailedGrowth``), the meter's reading and limit at
the step's start, and the calm steps since the last plan change. After calm steps it proposes the
plan with the fewest micro-steps predicted to fit in what is free now (``grow="model"``), or lets
the guard double blindly (``grow="double"``, or ``"auto"`` with ``grow_after`` where no meter knows
the limit). It holds no plan and talks to no other rank: the guard agrees the plan and records it.

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

__all__ = ["check_growth_meter", "check_growth_options", "DEFAULT_GROW_AFTER", "DEFAULT_HEADROOM", "fitting_plan",
    "FailedGrowth", "fits", "GrowMode", "Growth", "memory_limit", "predicted_rise", "prior_of", "Rise"]


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
#: calm steps before growing, where ``grow_after`` is not given
DEFAULT_GROW_AFTER = 2
#: the fraction of the limit a predicted size keeps free, where neither ``headroom`` nor a probe report gives one
DEFAULT_HEADROOM = 0.1


def check_growth_options(grow: str, grow_after: int | None, memory_model: object) -> None:
    """``grow``, ``grow_after`` and ``memory_model`` as ``OOMGuard`` takes them (ValueError/TypeError)."""
    if grow_after is not None:
        check_positive_int(grow_after, "grow_after")
    check_choice(grow, "grow", get_args(GrowMode))
    if memory_model is not None and not isinstance(memory_model, MemoryModel):
        raise TypeError(f"memory_model must be an autoaccum.MemoryModel (a probe report's .model), got "
                        f"{type(memory_model).__name__}")


def prior_of(plan: object, memory_model: MemoryModel | None, headroom: float | None) -> tuple[MemoryModel | None, float]:
    """The memory model and headroom growth uses: those given, else a probe report's (``plan``), else
    no model and ``DEFAULT_HEADROOM``."""
    report_model = getattr(plan, "model", None)
    model = memory_model if memory_model is not None else (
        report_model if isinstance(report_model, MemoryModel) else None)
    report_headroom = getattr(plan, "headroom", None) if isinstance(report_model, MemoryModel) else None
    return model, check_headroom(headroom if headroom is not None else
                                 report_headroom if report_headroom is not None else DEFAULT_HEADROOM)


class Growth:
    """One guard's growth state (arguments as ``OOMGuard``'s, checked there).

    Attributes:
        rises: what clean full steps took, per micro-batch size.
        failures: growths that ran out of memory (or thrashed), against the room they had.
        grown: the plan in force was grown and has not run a clean step yet.
        limit: the meter's limit at this step's start (read only for memory-guided growth).
        start: the meter at this step's start.
        calm: clean steps since the last plan change.
    """

    def __init__(self, grow: GrowMode, grow_after: int | None, memory_model: MemoryModel | None,
                 headroom: float) -> None:
        self.grow, self.grow_after, self.memory_model, self.headroom = grow, grow_after, memory_model, headroom
        self.rises: dict[int, Rise] = {}
        self.failures: list[FailedGrowth] = []
        self.grown = False
        self.limit: int | None = None
        self.start: MemoryReading | None = None
        self.calm = 0
        self._start_ooms = 0  # the emulated budget's OOM count at this step's start
        self._fwd_bwd: MemoryReading | None = None  # the meter after this step's forward/backward passes
        self._full_step = False  # the step holds this rank's whole share (a partial one measures nothing)

    def fresh(self) -> Growth:
        """A record with the same settings and nothing measured (the step changed: another memory
        saver); the probe's memory model is dropped too, as it was measured for the other one."""
        return Growth(self.grow, self.grow_after, None, self.headroom)

    @property
    def guided(self) -> bool:
        """Memory-guided growth is asked for (where the meter allows it)."""
        return self.grow in ("auto", "model")

    @property
    def calm_needed(self) -> int:
        return self.grow_after if self.grow_after is not None else DEFAULT_GROW_AFTER

    @property
    def doubles(self) -> bool:
        """Blind growth: asked for, or asked for with ``grow_after`` where memory cannot guide it."""
        return self.grow == "double" or (self.grow == "auto" and self.grow_after is not None and self.limit is None)

    # -- one step ---------------------------------------------------------------------------------------
    def begin(self, meter: Meter, *, full_step: bool, read_limit: bool) -> MemoryReading | None:
        """At a step's start: the meter's reading (peak reset) and, where ``read_limit``, its limit
        (CUDA: two allocator queries, so only where memory-guided growth needs it)."""
        meter.reset_peak()
        self.start = meter.read()
        self._start_ooms = getattr(meter, "oom_count", 0)
        self._full_step = full_step
        self.limit = memory_limit(meter) if self.start is not None and read_limit else None
        return self.start

    def may_grow(self, plan: Plan, initial_micro_batch: int) -> bool:
        """Calm steps enough, and below the initial micro-batch: memory-guided growth asks this step."""
        return self.calm >= self.calm_needed and plan.micro_batch < initial_micro_batch

    def fitting(self, plan: Plan, initial_micro_batch: int) -> Plan | None:
        """The plan with the fewest micro-steps predicted to fit in what is free now (this rank's
        proposal), up to the initial micro-batch; None where none does."""
        assert self.start is not None and self.limit is not None
        live_bytes, limit_bytes = self.start.current_bytes, self.limit
        return fitting_plan(plan, initial_micro_batch, lambda b: fits(
            b, live_bytes=live_bytes, limit_bytes=limit_bytes, headroom=self.headroom, rises=self.rises,
            prior=self.memory_model, failures=self.failures))

    def passes_done(self, meter: Meter) -> None:
        """After the forward/backward passes succeeded on every rank, before the optimizer step."""
        self._fwd_bwd = meter.read() if self.limit is not None else None

    def measured(self, micro_batch: int, end: MemoryReading | None) -> None:
        """After a clean step: what a step at this size took, and the room it had."""
        self.grown = False
        fwd_bwd, self._fwd_bwd = self._fwd_bwd, None
        start = self.start
        if self.limit is None or not self._full_step or start is None or end is None or fwd_bwd is None:
            return
        fwd_bwd_rise = fwd_bwd.peak_bytes - start.current_bytes
        # what the step left live (the optimizer state its first step creates) is in the next step's
        # start, not in its rise
        kept = max(0, end.current_bytes - start.current_bytes)
        rise = Rise(micro_batch, fwd_bwd_rise, max(fwd_bwd_rise, end.peak_bytes - start.current_bytes - kept),
                    self.limit - start.current_bytes)
        old = self.rises.get(micro_batch)
        self.rises[micro_batch] = rise if old is None else old.merged(rise)
        # a size at least this large failed earlier, with no more room than this: that record is stale
        self.failures = [f for f in self.failures if f.micro_batch > micro_batch or f.free_bytes > rise.free_bytes]

    def failed(self, meter: Meter, micro_batch: int, *, local: bool) -> None:
        """The first step of a grown plan ran out of memory; where it struck on this rank, remember the
        size against the room it had (and how far it got), so it is not retried until more is free."""
        self.grown = False
        start, limit_bytes = self.start, self.limit
        if not local or limit_bytes is None or start is None:
            return
        now = meter.read()
        reached = 0 if now is None else now.peak_bytes - start.current_bytes
        needed = meter.last_oom_needed_bytes
        short = 0
        if needed is not None and getattr(meter, "oom_count", 0) > self._start_ooms:  # the budget's own OOM
            short, reached = max(needed - limit_bytes, 0), max(reached, needed - start.current_bytes)
        self.failures.append(FailedGrowth(micro_batch, limit_bytes - start.current_bytes, short, max(reached, 0)))

    def thrashed(self, micro_batch: int) -> None:
        """The allocator thrashed at this size: with memory-guided growth, not back to it soon."""
        if self.limit is not None and self.start is not None:
            self.failures.append(FailedGrowth(micro_batch, self.limit - self.start.current_bytes))

    def count_calm(self, attempts: int) -> None:
        """After a successful step: calm if it ran without an OOM."""
        self.calm = self.calm + 1 if attempts == 1 else 0

    def predicted_rise(self, micro_batch: int) -> int | None:
        """A step's predicted rise at ``micro_batch`` from the record (``predicted_rise``)."""
        return predicted_rise(micro_batch, self.rises, self.memory_model, self.failures)


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
