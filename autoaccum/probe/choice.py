"""Which size to plan at among those that fit: the whole optimizer step's measured time, plans within
timing noise tied and ties going to the fewest passes; where speed alone picks a size below the
largest that fits, both are timed again (``Stepper.retime``) before the choice is final."""

from __future__ import annotations

from collections.abc import Iterable

from autoaccum.plan.plan import Plan
from autoaccum.probe.passes import Stepper
from autoaccum.probe.report import Candidate

__all__ = ["RETIME_ROUNDS", "THROUGHPUT_TIE", "choose", "choose_micro_batch", "plan_step_times", "time_slope"]


#: plans whose measured step times are within this fraction of the fastest count as a tie (timing
#: noise), and ties go to the plan with the fewest forward/backward passes
THROUGHPUT_TIE = 0.05


def time_slope(candidates: Iterable[Candidate]) -> float | None:
    """Seconds a pass takes per sample: the least-squares slope of the pass times over the sizes timed (one
    length); None where fewer than two sizes were timed or the slope is not positive (noise)."""
    points = [(c.micro_batch, c.micro_step_time_s) for c in candidates
              if c.status == "ok" and c.micro_step_time_s is not None]
    if len({b for b, _ in points}) < 2:
        return None
    mean_b = sum(b for b, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points)
    return slope if slope > 0 else None


def plan_step_times(candidates: Iterable[Candidate], share: int, min_micro_batch: int = 1) -> dict[int, float]:
    """Each fitting size's estimated optimizer step for ``share`` samples cut at it (``Candidate.plan_step_time_s``)."""
    fitting = [c for c in candidates if c.status == "ok" and c.step_time_s is not None]
    slope = time_slope(fitting)
    return {c.micro_batch: c.plan_step_time_s(share, min_micro_batch, slope) or 0.0 for c in fitting}


def choose_micro_batch(candidates: Iterable[Candidate], share: int | None = None, min_micro_batch: int = 1) -> int:
    """The fitting size whose plan for ``share`` samples steps fastest by measurement (``plan_step_times``); plans
    within THROUGHPUT_TIE of the fastest tie (timing noise), and ties go to the fewest passes, then to the larger
    size. Without ``share``: the best measured samples/s of one micro-batch, ties to the larger."""
    fitting = [c for c in candidates if c.status == "ok"]
    if share is None:
        best = max(c.samples_per_s or 0.0 for c in fitting)
        return max(c.micro_batch for c in fitting if (c.samples_per_s or 0.0) >= best * (1 - THROUGHPUT_TIE))
    times = plan_step_times(fitting, share, min_micro_batch)
    if not times:  # nothing timed (an estimate): the largest
        return max(c.micro_batch for c in fitting)
    fastest = min(times.values())
    tied = [b for b, t in times.items() if t <= fastest * (1 + THROUGHPUT_TIE)]
    return min(tied, key=lambda b: (Plan.for_target(share, b, 1, min_micro_batch).accum_steps, -b))


#: most rounds of timing the chosen size and the largest again (two passes a round)
RETIME_ROUNDS = 2


def choose(stepper: Stepper, share: int, min_micro_batch: int) -> int:
    """``choose_micro_batch``, timing again where it matters: while a size other than the largest that fits wins,
    both are timed once more, interleaved, and chosen from again on the fastest readings (RETIME_ROUNDS at most)."""
    chosen = choose_micro_batch(stepper.current.values(), share, min_micro_batch)
    for _ in range(RETIME_ROUNDS):
        # a size whose retiming ran out of memory is no longer among those that fit
        largest = max(c.micro_batch for c in stepper.current.values() if c.status == "ok")
        if chosen == largest:
            break
        for size in (chosen, largest):
            stepper.retime(size)
        chosen = choose_micro_batch(stepper.current.values(), share, min_micro_batch)
    return chosen
