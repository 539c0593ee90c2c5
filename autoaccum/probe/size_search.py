"""The search over micro-batch sizes at one length: which sizes the probe measures, in what order.

Sizes are chosen, not stepped through: the model's smallest (two complete training steps: the optimizer's
state and peak), a safe second size from that one measurement, then the limit the fitted memory
model predicts, verified by a measurement, refined by bisection where the points do not follow
the model. The forward/backward peak is convex in ``b`` on many models, so jumps are capped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from autoaccum.errors import DoesNotFitError
from autoaccum.memory.model import MemoryModel, MemoryPoint
from autoaccum.probe.passes import Stepper
from autoaccum.probe.report import Candidate

__all__ = ["LIMIT_TOLERANCE", "LONG_JUMP_FRACTION", "MAX_JUMP", "MIN_FIT_SPAN", "fit_sizes", "search_sizes"]

logger = logging.getLogger("autoaccum.probe")

#: the most the probe multiplies the largest fitting size by in one jump
MAX_JUMP = 8
#: how far towards a predicted limit more than 2x past the largest fitting size the probe jumps
LONG_JUMP_FRACTION = 0.75
#: the sizes a fit goes through span at least this share of the largest (more points are taken where
#: the ``largest`` biggest are closer together): a CUDA allocator rounds blocks to 2 MiB, so peaks a few
#: samples apart can differ by less than that rounding, or not at all, and a line through them alone
#: has no slope to speak of
MIN_FIT_SPAN = 0.10
#: the search stops refining once the limit is known (measured, or predicted by a good fit) to within
#: this share of the largest size that fits and no size in that band would change the plan: near the
#: limit each pass costs the most, and a closer bracket would change neither the plan nor (much) the
#: size the guard may grow back to
LIMIT_TOLERANCE = 0.02


def fit_sizes(candidates: Iterable[Candidate], share: int, largest: int = 3) -> MemoryModel | None:
    """The model fitted on the ``largest`` biggest sizes that ran, and on smaller ones where those
    span less than MIN_FIT_SPAN of the biggest.

    Sizes below ``share`` were measured as accumulation steps (gradients held while the next
    micro-batch runs); the whole share runs alone, a point on another line, used only when there
    are not two accumulating ones.

    The forward/backward peak is convex in ``b`` (at small ``b`` the peak sits late in backward,
    where gradients dominate; at large ``b`` at its start, where activations do), so a line
    through the sizes near the limit predicts the limit better than one through all sizes."""
    ran = sorted((c for c in candidates if c.fwd_bwd_peak_bytes is not None), key=lambda c: c.micro_batch)
    accumulating = [c for c in ran if c.micro_batch < share]
    ran = accumulating if len(accumulating) >= 2 else ran
    if len(ran) < 2:
        return None
    top = ran[-1].micro_batch
    take = min(largest, len(ran))
    while take < len(ran) and top - ran[-take].micro_batch < MIN_FIT_SPAN * top:
        take += 1
    return MemoryModel.fit([MemoryPoint(c.micro_batch, c.fwd_bwd_peak_bytes, c.opt_peak_bytes)  # type: ignore[arg-type]
                            for c in ran[-take:]])


def _same_plan(lo: int, top: int, share: int) -> bool:
    """Whether every limit in ``lo..top`` cuts ``share`` samples into the same number of micro-batches."""
    return -(-share // lo) == -(-share // top)


def _next_size(stepper: Stepper, upper: int, budget_bytes: int, headroom: float) -> tuple[int | None, str]:
    """The next size to measure, or None with the reason the search is done."""
    measured = stepper.current.values()
    lo = max(c.micro_batch for c in measured if c.status == "ok")
    hi = min((c.micro_batch for c in measured if c.status != "ok"), default=upper + 1)
    if lo >= upper or hi - lo <= 1:
        return None, f"limit bracketed by measurement: {lo} fits" + (f", {hi} does not" if hi <= upper else "")
    # Near the limit each pass costs the most: stop short of the last samples where they cannot change the
    # plan. Not at one length of variable-length data, whose plan comes from the token model, not from this.
    tolerant = stepper.length is None
    band = lo + int(LIMIT_TOLERANCE * lo)  # the sizes within the tolerance above the largest that fits
    if tolerant and hi <= upper and hi - 1 <= band and _same_plan(lo, hi - 1, stepper.share):
        return None, (f"limit bracketed by measurement to within {LIMIT_TOLERANCE:.0%}: {lo} fits, {hi} does not "
                      f"(the plan is the same at either)")
    model = fit_sizes(measured, stepper.share)
    # a limit past ``upper`` means ``upper`` itself is the size to verify, not a reason to bisect
    predicted = min(model.max_batch(budget_bytes, headroom), upper) if model is not None else 0
    # The model's limit is a prediction (peaks move in allocator blocks): the plan must be the same across
    # the whole band, not only up to the predicted size, or a limit the line puts a little short could cost
    # a micro-batch.
    if tolerant and model is not None and model.is_good_fit and model.num_points >= 3 and lo < predicted <= band \
            and predicted < hi and _same_plan(lo, min(band, hi - 1, upper), stepper.share):
        return None, (f"limit predicted within {LIMIT_TOLERANCE:.0%} of {lo}, which fits: the model puts it at "
                      f"{predicted} (residual {model.residual:.2%} on {model.num_points} sizes), and the plan is the "
                      f"same anywhere in that range")
    if model is not None and model.is_good_fit and predicted <= lo:
        if model.num_points >= 3:
            return None, f"fit verified at {lo}: residual {model.residual:.2%} on the {model.num_points} largest sizes"
        # two points put the limit at the largest size that fits: one size above it brackets it
        # (bisecting towards the share instead would run sizes the model already says do not fit)
        return lo + 1, ""
    if model is not None and model.is_good_fit and lo < predicted < hi:
        guess = predicted  # jump to the predicted limit, then verify it
        if predicted > 2 * lo:  # a long extrapolation: land short of it rather than past the budget
            guess = lo + int(LONG_JUMP_FRACTION * (predicted - lo))
    else:  # the points do not follow the model, or it predicts past a failure: bisection
        guess = (lo + hi) // 2
        if model is not None and not model.is_good_fit:
            logger.debug("probe: memory does not follow the model (residual %.1f%% > 5%%); bisecting",
                         100 * model.residual)
    if guess in stepper.current:
        guess = (lo + hi) // 2
    # Never extrapolate more than MAX_JUMP x past the largest size that fits: at small sizes the
    # peak sits late in backward and grows slowly with b, so a line through them overshoots.
    # Each capped jump lands in the steeper regime, and the next line goes through it.
    return max(lo + 1, min(guess, lo * MAX_JUMP)), ""


def search_sizes(stepper: Stepper, smallest: int, upper: int, budget_bytes: int, headroom: float,
            max_candidates: int) -> tuple[MemoryModel | None, str]:
    """Measure sizes until the largest fitting one is known (or the candidate budget is spent)."""
    usable = stepper.usable_bytes
    first = stepper.warm_up(smallest)
    if first.status != "ok":
        raise DoesNotFitError(first.peak_bytes, int(usable), at_least=first.status == "oom", micro_batch=smallest)
    if upper <= smallest:
        return None, f"only micro-batch {smallest} was needed"
    # A safe second size from one measurement: everything a pass at the smallest size added on top
    # of what was live at its start, and its inputs, bound the bytes per sample from above.
    start = stepper.start_bytes - stepper.batch_bytes[(smallest, stepper.length)]
    per_sample_bound = max((first.fwd_bwd_peak_bytes - start) / smallest, 1)  # type: ignore[operator]
    stepper.measure(min(max(int((usable - start) // per_sample_bound), smallest + 1), upper))
    while len(stepper.current) < max_candidates:
        size, note = _next_size(stepper, upper, budget_bytes, headroom)
        if size is None:
            return fit_sizes(stepper.current.values(), stepper.share), note
        stepper.measure(size)
    return fit_sizes(stepper.current.values(), stepper.share), f"stopped after {max_candidates} candidates"
