"""The probe: measure real training steps at a few micro-batch sizes, fit the memory model, plan.

The optimizer phase is measured once (two complete steps at the model's smallest size: the
optimizer creates its state in the first); each further size runs forward/backward passes only,
as the micro-batches of an accumulation step run (``autoaccum.stepper``). The forward/backward
peak and the optimizer-step peak are recorded apart. Sizes are chosen, not laddered: the smallest
the model trains at (1, or 2 with BatchNorm), a safe second size, then the size the fitted model
says is the largest under the budget, verified by a measurement, refined by bisection where the
model does not hold. Every pass runs under the run's precision (autocast, and a GradScaler for
fp16). Afterwards the model, optimizer and RNG are exactly as before (invariant 4).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from autoaccum import cache as probe_cache
from autoaccum import state as training_state
from autoaccum.batch import Batch
from autoaccum.batchnorm import smallest_micro_batch
from autoaccum.errors import DoesNotFitError
from autoaccum.estimate import fake_setup
from autoaccum.memory import (
    CudaMeter, TrackedMemory, device_capacity, refuse_compiled, resolve_budget, usable_bytes,
)
from autoaccum.memory_model import MemoryModel, MemoryPoint
from autoaccum.plan import Plan
from autoaccum.precision import Precision, autocast_dtype, check_precision, make_scaler
from autoaccum.report import Candidate, ProbeReport
from autoaccum.stepper import Stepper
from autoaccum.task import LossFn, Task, default_optimizer, resolve_task, trainable_parameters
from autoaccum.validate import check_positive_int

__all__ = ["Candidate", "ProbeReport", "choose_micro_batch", "probe"]

logger = logging.getLogger(__name__)

#: the most the probe multiplies the largest fitting size by in one jump
MAX_JUMP = 8
#: how far towards a predicted limit more than 2x past the largest fitting size the probe jumps
LONG_JUMP_FRACTION = 0.75
#: plans whose measured step times are within this fraction of the fastest count as a tie (timing
#: noise), and ties go to the plan with the fewest forward/backward passes
THROUGHPUT_TIE = 0.05


def _fit(candidates: Iterable[Candidate], share: int, largest: int = 3) -> MemoryModel | None:
    """The model fitted on the ``largest`` biggest sizes that ran.

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
    return MemoryModel.fit([MemoryPoint(c.micro_batch, c.fwd_bwd_peak_bytes, c.opt_peak_bytes)  # type: ignore[arg-type]
                            for c in ran[-largest:]])


def _next_size(stepper: Stepper, upper: int, budget_bytes: int, headroom: float) -> tuple[int | None, str]:
    """The next size to measure, or None with the reason the search is done."""
    measured = stepper.measured.values()
    lo = max(c.micro_batch for c in measured if c.status == "ok")
    hi = min((c.micro_batch for c in measured if c.status != "ok"), default=upper + 1)
    if lo >= upper or hi - lo <= 1:
        return None, f"limit bracketed by measurement: {lo} fits" + (f", {hi} does not" if hi <= upper else "")
    model = _fit(measured, stepper.share)
    # a limit past ``upper`` means ``upper`` itself is the size to verify, not a reason to bisect
    predicted = min(model.max_batch(budget_bytes, headroom), upper) if model is not None else 0
    if model is not None and model.is_good_fit and model.num_points >= 3 and predicted <= lo:
        return None, f"fit verified at {lo}: residual {model.residual:.2%} on the {model.num_points} largest sizes"
    if model is not None and model.is_good_fit and lo < predicted < hi:
        guess = predicted  # jump to the predicted limit, then verify it
        if predicted > 2 * lo:  # a long extrapolation: land short of it rather than past the budget
            guess = lo + int(LONG_JUMP_FRACTION * (predicted - lo))
    else:  # the points do not follow the model, or it predicts past a failure: bisection
        guess = (lo + hi) // 2
        if model is not None and not model.is_good_fit:
            logger.info("probe: memory does not follow the model (residual %.1f%% > 5%%); bisecting",
                        100 * model.residual)
    if guess in stepper.measured:
        guess = (lo + hi) // 2
    # Never extrapolate more than MAX_JUMP x past the largest size that fits: at small sizes the
    # peak sits late in backward and grows slowly with b, so a line through them overshoots.
    # Each capped jump lands in the steeper regime, and the next line goes through it.
    return max(lo + 1, min(guess, lo * MAX_JUMP)), ""


def _search(stepper: Stepper, smallest: int, upper: int, budget_bytes: int, headroom: float,
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
    start = stepper.start_bytes - stepper.batch_bytes[smallest]
    per_sample_bound = max((first.fwd_bwd_peak_bytes - start) / smallest, 1)  # type: ignore[operator]
    stepper.measure(min(max(int((usable - start) // per_sample_bound), smallest + 1), upper))
    while len(stepper.measured) < max_candidates:
        size, note = _next_size(stepper, upper, budget_bytes, headroom)
        if size is None:
            return _fit(stepper.measured.values(), stepper.share), note
        stepper.measure(size)
    return _fit(stepper.measured.values(), stepper.share), f"stopped after {max_candidates} candidates"


def choose_micro_batch(candidates: Iterable[Candidate], share: int | None = None, min_micro_batch: int = 1) -> int:
    """The fitting size whose plan for ``share`` samples steps fastest by measurement; plans within
    THROUGHPUT_TIE of the fastest tie (timing noise), and ties go to the fewest passes, then to the
    larger size. Without ``share``: the best measured samples/s of one micro-batch, ties to the larger."""
    fitting = [c for c in candidates if c.status == "ok"]
    if share is None:
        best = max(c.samples_per_s or 0.0 for c in fitting)
        return max(c.micro_batch for c in fitting if (c.samples_per_s or 0.0) >= best * (1 - THROUGHPUT_TIE))
    times = {c.micro_batch: c.plan_step_time_s(share, min_micro_batch) or 0.0 for c in fitting}
    fastest = min(times.values())
    tied = [b for b, t in times.items() if t <= fastest * (1 + THROUGHPUT_TIE)]
    return min(tied, key=lambda b: (Plan.for_target(share, b, 1, min_micro_batch).accum_steps, -b))


def _choose(stepper: Stepper, share: int, min_micro_batch: int) -> int:
    """:func:`choose_micro_batch`, with the timing repeated where it matters: when the choice is not
    the largest size that fits (it wins only by speed), both are timed once more, interleaved, and
    the choice is made again on the fastest readings."""
    chosen = choose_micro_batch(stepper.measured.values(), share, min_micro_batch)
    largest = max(c.micro_batch for c in stepper.measured.values() if c.status == "ok")
    if chosen != largest:
        for size in (chosen, largest, chosen, largest):
            stepper.retime(size)
        chosen = choose_micro_batch(stepper.measured.values(), share, min_micro_batch)
    return chosen


def _new_optimizer(make_optimizer: Callable[..., Any], model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    return optimizer


def _check_args(target_batch: int, world_size: int, steps_per_size: int, max_candidates: int) -> None:
    check_positive_int(target_batch, "target_batch")
    check_positive_int(world_size, "world_size")
    check_positive_int(steps_per_size, "steps_per_size")
    if steps_per_size < 2:
        raise ValueError(f"Invalid steps_per_size: {steps_per_size}. Allowed range: >= 2 (the first pass at a "
                         f"size warms up; the others are timed)")
    check_positive_int(max_candidates, "max_candidates")
    if max_candidates < 3:
        raise ValueError(f"Invalid max_candidates: {max_candidates}. Allowed range: >= 3")


def probe(
    task: Task | None = None,
    *,
    model: torch.nn.Module | None = None,
    loss_fn: LossFn | None = None,
    make_batch: Callable[[int], Batch] | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    target_batch: int = 256,
    world_size: int = 1,
    budget: int | str | None = None,
    headroom: float = 0.1,
    precision: Precision = "fp32",
    max_micro_batch: int | None = None,
    estimate: bool = False,
    steps_per_size: int = 2,
    max_candidates: int = 12,
    cache: bool = False,
    refresh: bool = False,
    cache_dir: str | None = None,
) -> ProbeReport:
    """Measure the memory and speed of real training steps and plan micro-batch x accumulation.

    Give either a :class:`Task` or its parts (``model``, ``loss_fn``, ``make_batch`` and an
    ``optimizer`` instance or factory; default AdamW). Steps run on the model's device.

    Args:
        target_batch: samples per optimizer step over all ranks; the plan covers it exactly.
        world_size: data-parallel ranks sharing the target.
        budget: bytes the step may use ("8GiB", "8 GB", int). Default: what the device has free
            (CUDA: free + this process's cache; CPU: available host RAM). On devices other than
            CUDA the budget is enforced by the tracked counter (an emulated OOM at the crossing).
        headroom: fraction of the budget kept free (fragmentation, other processes), in [0, 1).
        precision: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + GradScaler): measure as
            training will run.
        max_micro_batch: largest size worth trying (default: the per-rank share of the target).
        estimate: run the steps on fake tensors (no memory, no real compute): a fake-``cpu``
            estimate, reported as such; CPU kernels differ from a GPU's.
        steps_per_size: forward/backward passes per size, at least 2 (the first warms up).
        max_candidates: most sizes to measure.
        cache, cache_dir: reuse a report with the same fingerprint (see ``autoaccum.cache``).
        refresh: with ``cache``, measure anyway and overwrite the cached report.

    Returns:
        A :class:`ProbeReport` with the plan, the candidates and the fitted model.

    Raises:
        DoesNotFitError: the smallest micro-batch the model trains at does not fit in the budget.
        ValueError, TypeError: invalid arguments.
    """
    factory = optimizer if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) \
        else default_optimizer
    task = resolve_task(task, model=model, loss_fn=loss_fn, make_batch=make_batch, make_optimizer=factory)
    _check_args(target_batch, world_size, steps_per_size, max_candidates)
    check_precision(precision)
    smallest = smallest_micro_batch(task.model)
    share = Plan.for_target(target_batch, 1, world_size).rank_batch(0)
    upper = share if max_micro_batch is None else min(check_positive_int(max_micro_batch, "max_micro_batch"), share)
    smallest = min(smallest, upper)
    device = trainable_parameters(task.model)[0].device
    if estimate or device.type != "cuda":
        refuse_compiled(task.model, "probe it")
    capacity = device_capacity(device)
    plan_budget = resolve_budget(budget, device, headroom)
    task.batch(1)  # fail fast on a batch maker that returns the wrong size
    fingerprint = probe_cache.fingerprint(task, optimizer, device=device, capacity_bytes=capacity.total_bytes,
                                          budget_bytes=plan_budget.budget_bytes, headroom=headroom,
                                          target_batch=target_batch, world_size=world_size, upper=upper,
                                          estimate=estimate, precision=precision)
    if cache and not refresh:
        cached = probe_cache.load(fingerprint, cache_dir)
        if cached is not None:
            return cached
    started = time.perf_counter()
    stepper, model_fit, note, best = _measure(task, optimizer, precision, plan_budget.budget_bytes,
                                              plan_budget.headroom, estimate=estimate, share=share, smallest=smallest,
                                              upper=upper, passes=steps_per_size, max_candidates=max_candidates)
    report = ProbeReport(
        plan=Plan.for_target(target_batch, best, world_size, smallest), candidates=tuple(stepper.measured.values()),
        model=model_fit, device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        meter="fake" if estimate else stepper.meter.kind, is_estimate=estimate,
        budget_bytes=plan_budget.budget_bytes, budget_source=plan_budget.source, headroom=plan_budget.headroom,
        probe_steps=stepper.steps, probe_ooms=stepper.ooms, wall_time_s=time.perf_counter() - started,
        fit_note=note, precision=precision, optimizer_steps=stepper.optimizer_steps, fingerprint=fingerprint,
    )
    if cache:
        probe_cache.store(report, cache_dir)
    return report


def _measure(task: Task, optimizer: Any, precision: Precision, budget_bytes: int, headroom: float, *,
             estimate: bool, share: int, smallest: int, upper: int, passes: int,
             max_candidates: int) -> tuple[Stepper, MemoryModel | None, str, int]:
    """Run the measurements (on fake tensors for an estimate) and choose the size (timing again where it
    matters); the task's state is restored after both. Returns the stepper, the model, its note and the size."""
    device = trainable_parameters(task.model)[0].device
    run_model, make_optimizer = task.model, task.make_optimizer
    run_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    snapshot = training_state.capture(task.model, run_optimizer)
    fake_mode: Any = None
    if estimate:  # fake cpu tensors: see autoaccum.estimate
        fake_mode, run_model, make_optimizer = fake_setup(task.model, optimizer, make_optimizer)
        run_optimizer, device = None, torch.device("cpu")
    meter: Any = CudaMeter(device, budget_bytes) if device.type == "cuda" and not estimate else \
        TrackedMemory(budget_bytes=None if estimate else budget_bytes)
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            if run_optimizer is None:
                run_optimizer = _new_optimizer(make_optimizer, run_model)
            if isinstance(meter, TrackedMemory):
                meter.track(run_model, run_optimizer)
            with meter:
                stepper = Stepper(run_model, run_optimizer, task.loss_fn, task.batch, device, meter,
                                  usable_bytes(budget_bytes, headroom),
                                  share=share, passes=passes, autocast_dtype=autocast_dtype(precision),
                                  scaler=None if estimate else make_scaler(precision, device))
                model_fit, note = _search(stepper, smallest, upper, budget_bytes, headroom, max_candidates)
                # Fake steps take no real time: an estimate plans from memory alone.
                best = max(c.micro_batch for c in stepper.measured.values() if c.status == "ok") if estimate \
                    else _choose(stepper, share, smallest)
    finally:
        if isinstance(meter, TrackedMemory):
            meter.close()
        if not estimate:
            training_state.restore(snapshot, task.model, run_optimizer if isinstance(optimizer, torch.optim.Optimizer)
                                   else None)
        else:
            training_state.restore_rng(snapshot.rng)
    return stepper, model_fit, note, best
