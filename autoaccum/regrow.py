"""Regrowth guided by memory: how large the micro-batch may grow again, from what is free now.

After an OOM the guard halves the micro-batch: the same samples, the same result, the right first
reaction. Halving overshoots (a micro-batch of 147 drops to 73 where about 100 would fit), and
memory that someone else took may come back. Growing back blindly (doubling, never to a size that
once failed) costs a failed attempt whenever the guess is wrong and never returns to the size a
transient squeeze made fail. So the guard measures each clean step at the size it ran -- how far
the step's memory rose above the bytes live at its start (the forward/backward peak and the whole
step's peak) and how much was free then -- and, after calm steps, grows straight to the largest
micro-batch predicted to fit in what is free now:

- a size that ran cleanly fits again where at least as much memory is free as when it ran (a
  measurement: no headroom needed);
- another size fits where the bytes live now plus its predicted rise stay within the usable part
  of the limit, ``limit x (1 - headroom)`` (:func:`autoaccum.memory.usable_bytes`). The predicted
  rise is the largest of the estimates at hand: the memory model ``max(optimizer rise, base +
  per_sample x b)`` fitted on the sizes measured (:class:`autoaccum.memory_model.MemoryModel`);
  the probe's bytes per sample anchored on the largest size measured below; and -- with one size
  measured and no probe, or where a growth past that size failed -- its rise scaled in
  proportion to ``b`` (an upper bound: the part of the rise that does not grow with ``b`` --
  gradients, optimizer temporaries -- is not negative). Nothing measured below: it does not fit;
- a size at or above one whose growth ran out of memory is not tried again until more is free
  than when it failed (by at least what the failed allocation lacked, where the meter says); the
  bytes that failed attempt reached (a lower bound on its rise) join the line as a point and
  raise the estimates of sizes at or above it, and between the size that ran and the one that
  failed only the upper bound decides: a failed growth is followed by no other failed growth
  while the room stays the same.

The limit (:func:`memory_limit`) is the emulated budget of a :class:`~autoaccum.memory.TrackedMemory`,
or on CUDA what this process can reach: free device memory plus its allocator's cache, within the
per-process fraction (:func:`autoaccum.memory.cuda_capacity`, without NVML). The guard keeps the
record; everything here is a function of plain values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from autoaccum.memory import Meter, usable_bytes
from autoaccum.memory_model import MemoryModel, MemoryPoint

__all__ = ["FailedGrowth", "Rise", "fits", "memory_limit", "predicted_rise"]


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
    else the meter's ``budget_bytes`` (None for :class:`~autoaccum.memory.NullMeter`)."""
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
    """How far a step at ``micro_batch`` is predicted to rise above the bytes live at its start
    (the largest of the estimates in the module docstring); None where nothing can be estimated."""
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

