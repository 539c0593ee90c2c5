"""The probe: measure real training steps at a few micro-batch sizes, fit the memory model, plan.

For each candidate size the probe runs ``steps_per_size`` complete training steps (forward,
backward, optimizer step; the optimizer's state appears lazily in the first, so the peak is
usually in the second) and records the forward/backward peak and the optimizer-step peak apart.
Candidates are chosen, not laddered: two small sizes, then the size the fitted model says is the
largest under the budget, verified by a measurement, refined by bisection where the model does
not hold. Afterwards the model, optimizer and RNG are exactly as before (invariant 4).
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
from autoaccum.batch import Batch, move_to
from autoaccum.errors import DoesNotFitError
from autoaccum.estimate import fake_setup
from autoaccum.memory import CudaMeter, Meter, TrackedMemory, device_capacity, resolve_budget
from autoaccum.memory_model import MemoryModel, MemoryPoint
from autoaccum.plan import Plan
from autoaccum.recovery import catch_oom, release_memory
from autoaccum.report import Candidate, ProbeReport, Status
from autoaccum.task import LossFn, Task, check_loss, default_optimizer, resolve_task, trainable_parameters
from autoaccum.validate import check_positive_int

__all__ = ["Candidate", "ProbeReport", "probe", "choose_micro_batch"]

logger = logging.getLogger(__name__)

#: the most the probe multiplies the largest fitting size by in one jump
MAX_JUMP = 8
#: how far towards a predicted limit more than 2x past the largest fitting size the probe jumps
LONG_JUMP_FRACTION = 0.75
#: throughputs within this fraction of the best count as a tie, and ties go to the larger size
THROUGHPUT_TIE = 0.05


# -- measuring one size ---------------------------------------------------------------------------

class _Stepper:
    """Runs measured training steps of one task on one meter."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                 make_batch: Callable[[int], Batch], device: torch.device, meter: Meter,
                 usable_bytes: int, steps_per_size: int, share: int) -> None:
        self.model, self.optimizer, self.loss_fn, self.make_batch = model, optimizer, loss_fn, make_batch
        self.device, self.meter, self.usable_bytes, self.steps_per_size = device, meter, usable_bytes, steps_per_size
        self.share = share  # a micro-batch smaller than this rank's share accumulates
        self.steps = 0
        self.ooms = 0
        self.measured: dict[int, Candidate] = {}
        self.start_bytes = 0  # bytes live when the last measured step began (weights, state, batch)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run(self, size: int) -> Candidate:
        fwd_bwd = opt = 0
        times: list[float] = []
        batch = move_to(self.make_batch(size), self.device)
        # In an accumulation step every micro-batch after the first runs forward and backward with
        # the summed gradients of the earlier ones in memory: a size that will accumulate keeps its
        # gradients from step to step, so that steps 2.. measure exactly that peak. A size that is
        # the whole share runs alone, and starts each step without gradients as the guard does.
        accumulates = size < self.share
        for step in range(self.steps_per_size):
            if step == 0 or not accumulates:
                self.optimizer.zero_grad(set_to_none=True)
            self._sync()
            start = time.perf_counter()
            self.meter.reset_peak()
            self.start_bytes = self.meter.current_bytes
            loss, _ = check_loss(self.loss_fn(self.model, batch))
            loss.backward()
            del loss
            fwd_bwd = max(fwd_bwd, self.meter.peak_bytes)
            self.meter.reset_peak()
            self.optimizer.step()
            opt = max(opt, self.meter.peak_bytes)
            self._sync()
            times.append(time.perf_counter() - start)
            self.steps += 1
        peak = max(fwd_bwd, opt)
        status: Status = "ok" if peak <= self.usable_bytes else "over_budget"
        return Candidate(size, status, peak, fwd_bwd, opt, min(times[1:] or times))

    def measure(self, size: int) -> Candidate:
        if size in self.measured:
            return self.measured[size]
        ran, failed = catch_oom(self._run, size)
        if failed:  # outside any except block: the failed step's activations are gone
            self.steps += 1
            self.ooms += 1
            self.optimizer.zero_grad(set_to_none=True)
            release_memory(self.device)
            candidate = Candidate(size, "oom", self.meter.last_oom_needed_bytes)
        else:
            candidate = ran  # type: ignore[assignment]
        self.optimizer.zero_grad(set_to_none=True)
        self.measured[size] = candidate
        logger.info("probe micro-batch %d: %s, peak %s", size, candidate.status, candidate.peak_bytes)
        return candidate


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


def _search(stepper: _Stepper, upper: int, budget_bytes: int, headroom: float,
            max_candidates: int) -> tuple[MemoryModel | None, str]:
    """Measure sizes until the largest fitting one is known (or the candidate budget is spent)."""
    usable = stepper.usable_bytes
    first = stepper.measure(1)
    if first.status != "ok":
        raise DoesNotFitError(first.peak_bytes, int(usable), at_least=first.status == "oom")
    if upper == 1:
        return None, "only micro-batch 1 was needed"
    # A safe second size from one measurement: everything a one-sample step added on top of what
    # was live at its start is an upper bound on the bytes per sample (it includes the gradients).
    start = stepper.start_bytes
    per_sample_bound = max(first.fwd_bwd_peak_bytes - start, 1)  # type: ignore[operator]
    stepper.measure(min(max(int((usable - start) // per_sample_bound), 2), upper))
    note = ""
    while len(stepper.measured) < max_candidates:
        measured = stepper.measured.values()
        lo = max(c.micro_batch for c in measured if c.status == "ok")
        hi = min((c.micro_batch for c in measured if c.status != "ok"), default=upper + 1)
        if lo >= upper or hi - lo <= 1:
            note = f"limit bracketed by measurement: {lo} fits" + (f", {hi} does not" if hi <= upper else "")
            break
        model = _fit(measured, stepper.share)
        # a limit past ``upper`` means ``upper`` itself is the size to verify, not a reason to bisect
        predicted = min(model.max_batch(budget_bytes, headroom), upper) if model is not None else 0
        if model is not None and model.is_good_fit and model.num_points >= 3 and predicted <= lo:
            note = f"fit verified at {lo}: residual {model.residual:.2%} on the {model.num_points} largest sizes"
            break
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
        stepper.measure(max(lo + 1, min(guess, lo * MAX_JUMP)))
    else:
        note = f"stopped after {max_candidates} candidates"
    return _fit(stepper.measured.values(), stepper.share), note


def choose_micro_batch(candidates: Iterable[Candidate]) -> int:
    """The fitting size with the best measured samples/s; sizes within THROUGHPUT_TIE of the best tie,
    and ties go to the larger size."""
    fitting = [c for c in candidates if c.status == "ok"]
    best = max(c.samples_per_s or 0.0 for c in fitting)
    return max(c.micro_batch for c in fitting if (c.samples_per_s or 0.0) >= best * (1 - THROUGHPUT_TIE))


# -- the public entry point ---------------------------------------------------------------------

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
        raise ValueError(f"Invalid steps_per_size: {steps_per_size}. Allowed range: >= 2 (optimizer state is "
                         f"created in the first step, so the peak is usually in the second)")
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
    max_micro_batch: int | None = None,
    estimate: bool = False,
    steps_per_size: int = 3,
    max_candidates: int = 10,
    cache: bool = False,
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
        max_micro_batch: largest size worth trying (default: the per-rank share of the target).
        estimate: run the steps on fake tensors (no memory, no real compute): a fake-``cpu``
            estimate, reported as such; CPU kernels differ from a GPU's.
        steps_per_size: training steps per candidate, at least 2.
        max_candidates: most sizes to measure.
        cache, cache_dir: reuse a report with the same fingerprint (see ``autoaccum.cache``).

    Returns:
        A :class:`ProbeReport` with the plan, the candidates and the fitted model.

    Raises:
        DoesNotFitError: a micro-batch of 1 does not fit in the budget.
        ValueError, TypeError: invalid arguments.
    """
    factory = optimizer if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) \
        else default_optimizer
    task = resolve_task(task, model=model, loss_fn=loss_fn, make_batch=make_batch, make_optimizer=factory)
    _check_args(target_batch, world_size, steps_per_size, max_candidates)
    share = Plan.for_target(target_batch, 1, world_size).rank_batch(0)
    upper = share if max_micro_batch is None else min(check_positive_int(max_micro_batch, "max_micro_batch"), share)
    params = trainable_parameters(task.model)
    device = params[0].device
    capacity = device_capacity(device)
    plan_budget = resolve_budget(budget, device, headroom)
    budget_bytes, usable = plan_budget.budget_bytes, plan_budget.usable_bytes
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    task.batch(1)  # fail fast on a batch maker that returns the wrong size

    fingerprint = probe_cache.fingerprint(task, optimizer, device=device, capacity_bytes=capacity.total_bytes,
                                          budget_bytes=budget_bytes, headroom=headroom, target_batch=target_batch,
                                          world_size=world_size, upper=upper, estimate=estimate)
    if cache:
        cached = probe_cache.load(fingerprint, cache_dir)
        if cached is not None:
            return cached

    started = time.perf_counter()
    make_optimizer = task.make_optimizer
    run_model = task.model
    run_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    snapshot = training_state.capture(task.model, run_optimizer)
    fake_mode: Any = None
    if estimate:  # fake cpu tensors: see autoaccum.estimate
        fake_mode, run_model, make_optimizer = fake_setup(task.model, optimizer, make_optimizer)
        run_optimizer = None
        device = torch.device("cpu")
    meter: Any
    if device.type == "cuda" and not estimate:
        meter = CudaMeter(device, budget_bytes)
    else:
        meter = TrackedMemory(budget_bytes=None if estimate else budget_bytes)
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            if run_optimizer is None:
                run_optimizer = _new_optimizer(make_optimizer, run_model)
            if isinstance(meter, TrackedMemory):
                meter.track(run_model, run_optimizer)
            with meter:
                stepper = _Stepper(run_model, run_optimizer, task.loss_fn, task.batch, device, meter, usable,
                                   steps_per_size=steps_per_size, share=share)
                model_fit, note = _search(stepper, upper, budget_bytes, headroom, max_candidates)
    finally:
        if isinstance(meter, TrackedMemory):
            meter.close()
        if not estimate:
            training_state.restore(snapshot, task.model, optimizer if isinstance(optimizer, torch.optim.Optimizer)
                                   else None)
        else:
            training_state.restore_rng(snapshot.rng)
    candidates = tuple(stepper.measured.values())
    # Fake steps take no real time: an estimate plans from memory alone.
    best = max(c.micro_batch for c in candidates if c.status == "ok") if estimate else choose_micro_batch(candidates)
    report = ProbeReport(
        plan=Plan.balanced(target_batch, best, world_size), candidates=candidates, model=model_fit,
        device=str(params[0].device), device_name=device_name, meter="fake" if estimate else meter.kind,
        is_estimate=estimate, budget_bytes=budget_bytes, budget_source=plan_budget.source, headroom=headroom,
        probe_steps=stepper.steps, probe_ooms=stepper.ooms, wall_time_s=time.perf_counter() - started,
        fit_note=note, fingerprint=fingerprint,
    )
    if cache:
        probe_cache.store(report, cache_dir)
    return report
