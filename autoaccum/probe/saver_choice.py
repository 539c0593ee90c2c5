"""Which memory saver a plan runs with: the first with which the smallest micro-batch fits
(``first_fitting``), then, from there up, the one whose plan steps fastest by measurement
(``fastest_saver``). ``Measured`` is what one measurement with one saver gave."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from autoaccum.errors import DoesNotFitError
from autoaccum.log import rank_level
from autoaccum.memory.model import MemoryModel, TokenMemoryModel
from autoaccum.memory.savers import describe_saver, suggestions
from autoaccum.plan.plan import Plan
from autoaccum.probe.choice import THROUGHPUT_TIE, plan_step_times, time_slope
from autoaccum.probe.passes import Stepper
from autoaccum.probe.progress_line import ProbeProgress

__all__ = ["Measured", "choose_saver", "fastest_saver", "first_fitting"]

logger = logging.getLogger("autoaccum.probe")


@dataclass(frozen=True)
class Measured:
    stepper: Stepper
    model: MemoryModel | None
    token_model: TokenMemoryModel | None
    note: str
    best: int  # the micro-batch chosen (for variable-length data: at the longest length)
    saver: str = "none"  # the memory saver it was measured on


def first_fitting(savers: tuple[str, ...], measure: Callable[[str], Measured], line: ProbeProgress
           ) -> tuple[Measured, list[tuple[str, int | None]]]:
    """Measure with each memory saver in turn, up to the first with which the smallest micro-batch fits; that saver's
    measurement and the (saver, bytes needed) of those below it."""
    tried: list[tuple[str, int | None]] = []
    for saver in savers:
        line.measuring_with(saver)
        try:
            return measure(saver), tried
        except DoesNotFitError as exc:
            tried.append((saver, exc.needed_bytes))
            if saver == savers[-1]:
                raise DoesNotFitError(exc.needed_bytes, exc.available_bytes, suggestions(savers),
                                      at_least=exc.at_least, micro_batch=exc.micro_batch, savers=tried) from None
            said = "without a memory saver" if saver == "none" else f"with {describe_saver(saver)}"
            logger.log(rank_level(logging.INFO), "probe: even micro-batch %d does not fit %s; measuring again "
                       "with %s", exc.micro_batch, said, describe_saver(savers[savers.index(saver) + 1]))
    raise RuntimeError("internal: no memory saver to measure with")  # allowed_savers() starts with "none"


def _plan_time(measured: Measured, share: int, smallest: int) -> float | None:
    """The measured step time of the plan ``measured`` chose (None where it was not timed)."""
    return plan_step_times(measured.stepper.current.values(), share, smallest).get(measured.best)


def _fewer_passes_may_pay(measured: Measured, share: int, smallest: int, step_time: float) -> bool:
    """Whether a saver could make ``measured``'s plan faster at all: at best it would run the share in one
    pass, saving every other pass's fixed cost (the intercept of the pass times against the micro-batch)
    and costing no recomputation. Where even that is within timing noise of the step, nothing is measured."""
    if measured.best >= share:
        return False
    timed = [c for c in measured.stepper.current.values() if c.status == "ok" and c.micro_step_time_s is not None]
    if not timed:
        return False
    slope = time_slope(timed)
    if slope is None:  # the pass times do not grow with the micro-batch: all of a pass is fixed cost
        fixed = min(c.micro_step_time_s for c in timed)  # type: ignore[type-var]
    else:
        mean_b = sum(c.micro_batch for c in timed) / len(timed)
        fixed = sum(c.micro_step_time_s for c in timed) / len(timed) - slope * mean_b  # type: ignore[misc]
    passes = Plan.for_target(share, measured.best, 1, smallest).accum_steps
    return (passes - 1) * fixed > THROUGHPUT_TIE * step_time


def fastest_saver(savers: tuple[str, ...], first: Measured, measure: Callable[[str], Measured],
                   line: ProbeProgress, share: int, smallest: int
                   ) -> tuple[Measured, list[tuple[str, int, float | None]]]:
    """The (micro-batch, saver) pair that steps fastest, from ``first`` (the first saver the smallest
    micro-batch fits with) up.

    Where ``first``'s plan accumulates, a higher saver may step faster: a larger micro-batch in fewer
    passes, for the recomputation it costs. Each higher saver below ``offload`` (which adds copies to the
    host, never speed) is measured in turn (at most log2 of the blocks, their counts doubling) while the
    best plan so far could still gain by running fewer passes (``_fewer_passes_may_pay``), and one wins
    where it steps faster than the best so far by more than timing noise (THROUGHPUT_TIE): a tie goes to
    less recomputation. All are measured, not only until one is slower: a saver may fit no larger
    micro-batch than the one below it (the same passes, more recomputation) where the next fits one more
    pass's worth. Every measurement's passes count in the report. Returns the winner and what was
    weighed: (saver, its plan's micro-batch, that plan's step time) for each saver measured."""
    best, best_time, runs = first, _plan_time(first, share, smallest), [first.stepper]
    weighed = [(first.saver, first.best, best_time)]
    for saver in savers[savers.index(first.saver) + 1:]:
        if saver == "offload" or best_time is None or not _fewer_passes_may_pay(best, share, smallest, best_time):
            break
        line.measuring_with(saver)
        measured = measure(saver)
        runs.append(measured.stepper)
        time = _plan_time(measured, share, smallest)
        weighed.append((saver, measured.best, time))
        logger.debug("probe: %s: a step of %s s against %.4g s", describe_saver(saver), time, best_time)
        if time is not None and time < best_time * (1 - THROUGHPUT_TIE):
            best, best_time = measured, time
    if len(runs) > 1:  # what every measurement ran counts in the report, whichever won
        best.stepper.steps, best.stepper.ooms, best.stepper.optimizer_steps = (
            sum(r.steps for r in runs), sum(r.ooms for r in runs), sum(r.optimizer_steps for r in runs))
    return best, weighed


def choose_saver(savers: tuple[str, ...], measure: Callable[[str], Measured], line: ProbeProgress, share: int,
                 smallest: int, *, weigh: bool
                 ) -> tuple[Measured, list[tuple[str, int | None]], list[tuple[str, int, float | None]]]:
    """The measurement the plan is made from: the first saver that fits (``first_fitting``), then, where
    ``weigh``, the fastest from there up (``fastest_saver``), on every device: also where a step fits without a
    saver, a CPU's too (where it fits one sample per pass, 16 passes of a step ran at 0.79x of checkpointing
    every block at 7 samples a pass: benchmarks/README.md). Returns it, the savers tried below it and those
    weighed (none where no saver above the first was measured)."""
    measured, tried = first_fitting(savers, measure, line)
    if not weigh:
        return measured, tried, []
    measured, weighed = fastest_saver(savers, measured, measure, line, share, smallest)
    return measured, tried, weighed if len(weighed) > 1 else []
