"""The probe: measure real training steps at a few micro-batch sizes, fit the memory model, plan.

The optimizer phase is measured once, in a warm-up of two complete steps at the model's smallest size; every
further size runs forward/backward passes only, as an accumulation's micro-batches do (``autoaccum.probe.passes``).
Sizes are chosen, not stepped through (``autoaccum.probe.size_search``): the smallest, a safe second size, then the
limit the fitted model predicts, verified, and bisected where the model does not hold. Among the sizes that fit, the
plan measured fastest wins (ties to fewer passes); sizes are timed again only where the choice hangs on it. Every pass
runs under the run's precision. Afterwards the model, optimizer and RNG are exactly as before (invariant 4); a
caller's optimizer is not even stepped where a ``StandIn`` can step for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from autoaccum import state as training_state
from autoaccum.memory import (
    CudaMeter,
    TrackedMemory,
    cuda_available_bytes,
    device_capacity,
    refuse_compiled,
    resolve_budget,
    usable_bytes,
)
from autoaccum.memory.model import MemoryModel, TokenMemoryModel
from autoaccum.memory.recovery import catch_oom, release_memory
from autoaccum.memory.savers import allowed_savers, apply_saver
from autoaccum.modules import is_compiled
from autoaccum.plan.batch import Batch, move_to
from autoaccum.plan.batchnorm import smallest_micro_batch
from autoaccum.plan.lengths import LengthProfile
from autoaccum.plan.plan import Plan, TokenBudget
from autoaccum.plan.task import LossFn, Task, check_loss_fn, default_optimizer, resolve_task, trainable_parameters
from autoaccum.precision import Precision, autocast_dtype, check_precision, make_scaler
from autoaccum.probe import cache as probe_cache
from autoaccum.probe.choice import choose
from autoaccum.probe.estimate import cuda_library_bytes, estimate_device, fake_setup, with_offset
from autoaccum.probe.length_search import search_lengths
from autoaccum.probe.passes import HostSnapshotNeeded, StandIn, Stepper
from autoaccum.probe.progress_line import ProbeProgress
from autoaccum.probe.report import Candidate, ProbeReport, model_fingerprint, model_summary
from autoaccum.probe.saver_choice import Measured, choose_saver
from autoaccum.probe.size_search import search_sizes
from autoaccum.state import WeightsCopy
from autoaccum.validate import check_positive_int

__all__ = ["Candidate", "ProbeReport", "probe"]

logger = logging.getLogger(__name__)

def _new_optimizer(make_optimizer: Callable[..., Any], model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    return optimizer


def _check_args(target_batch: int, world_size: int, steps_per_size: int | None, max_candidates: int, *,
                cache: bool, refresh: bool) -> None:
    if refresh and not cache:
        raise ValueError("refresh=True (--refresh) measures again and replaces the cached report, but cache=False "
                         "(--no-cache) neither reads nor writes the cache: give one of them")
    check_positive_int(target_batch, "target_batch")
    check_positive_int(world_size, "world_size")
    if steps_per_size is not None:
        check_positive_int(steps_per_size, "steps_per_size", hint=" passes, or None for the default")
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
    steps_per_size: int | None = None,
    max_candidates: int = 12,
    cache: bool = False,
    refresh: bool = False,
    cache_dir: str | None = None,
    lengths: Any = None,
    lengths_source: str = "",
    memory_savers: Any = "auto",
    weigh_savers: bool = True,
    progress: bool = False,
) -> ProbeReport:
    """Measure the memory and speed of real training steps and plan micro-batch x accumulation.

    Give either a ``Task`` or its parts (``model``, ``loss_fn``, ``make_batch`` and an
    ``optimizer`` instance or factory; default AdamW). Steps run on the model's device.

    Args:
        task: the model, loss, batch maker and optimizer factory; or None and the next four.
        model: the module to train (without ``task``).
        loss_fn: ``loss_fn(model, batch)`` -> mean loss or ``(loss_sum, num_items)`` (without ``task``).
        make_batch: ``make_batch(b)`` -> a batch of ``b`` samples (without ``task``).
        optimizer: an optimizer instance (restored afterwards) or a factory of one.
        target_batch: samples per optimizer step over all ranks; the plan covers it exactly.
        world_size: data-parallel ranks sharing the target.
        budget: bytes the step may use ("8GiB", "8 GB", int). Default: what the device has free (CUDA: free + this
            process's cache; CPU: available host RAM). Off CUDA the tracked counter enforces it (an emulated OOM).
        headroom: fraction of the budget kept free (fragmentation, other processes), in [0, 1).
        precision: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + GradScaler), as training runs.
        max_micro_batch: largest size worth trying (default: the per-rank share of the target).
        estimate: run the steps on fake tensors (no memory, no real compute), reported as an estimate: fake ``cuda``
            for a CUDA model (peaks plus the bytes cuBLAS and cuDNN keep), else fake ``cpu``, whose kernels differ.
        steps_per_size: forward/backward passes per size. Default 1 (2 for a ``torch.compile``-d model, whose first
            pass at a shape compiles); with 2 or more the first warms up and the fastest of the others is the time.
        max_candidates: most sizes to measure (at least 3).
        cache: reuse a stored report with the same fingerprint (``autoaccum.probe.cache``).
        refresh: with ``cache``, measure anyway and overwrite the stored report.
        cache_dir: where reports are stored (default ``~/.cache/autoaccum``).
        lengths: variable-length data: the samples' lengths (instead of ``Task.lengths``); ``make_batch(b, length)``
            then makes ``b`` samples padded to ``length``, and the plan is cut by a token budget.
        lengths_source: where ``lengths`` were read, for the report (e.g. "1,000 of 50,000 samples").
        memory_savers: where even the smallest micro-batch does not fit, measure again on the next memory saver
            (``autoaccum.memory.savers``): ``"auto"`` (default), ``"off"``, or a tuple of savers.
        weigh_savers: from the first saver with which the smallest micro-batch fits, measure the ones above it
            while fewer passes may pay, and plan the fastest (saver, micro-batch) pair; False plans on the first
            (the search, which weighs savers itself).
        progress: on a terminal, show the sizes measured so far on one line of stderr (cleared at the end;
            off a terminal nothing is written).

    Returns:
        A ``ProbeReport`` with the plan, the candidates and the fitted model.

    Raises:
        DoesNotFitError: the smallest micro-batch the model trains at does not fit with any savers.
        ValueError: an argument out of its range.
        TypeError: an argument of the wrong type.
    """
    factory = optimizer if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) \
        else default_optimizer
    task = resolve_task(task, model=model, loss_fn=loss_fn, make_batch=make_batch, make_optimizer=factory,
                        lengths=lengths)
    _check_args(target_batch, world_size, steps_per_size, max_candidates, cache=cache, refresh=refresh)
    check_loss_fn(task.loss_fn, "loss_fn")
    check_precision(precision)
    share = Plan.for_target(target_batch, 1, world_size).rank_batch(0)
    upper = share if max_micro_batch is None else min(check_positive_int(max_micro_batch, "max_micro_batch"), share)
    device = trainable_parameters(task.model)[0].device
    if estimate or device.type != "cuda":
        refuse_compiled(task.model, "probe it")
    savers = allowed_savers(task.model, device, memory_savers)
    capacity = device_capacity(device)
    plan_budget = resolve_budget(budget, device, headroom)
    one = task.batch(1)  # fail fast on a batch maker that returns the wrong size
    # with BatchNorm: whether one sample trains, by trying it (an estimate runs nothing real: 2 there)
    smallest = min(smallest_micro_batch(task.model, None if estimate else
                                        lambda: task.loss_fn(task.model, move_to(one, device))), upper)
    fingerprint = probe_cache.fingerprint(task, optimizer, device=device, capacity_bytes=capacity.total_bytes,
                                          budget_bytes=plan_budget.budget_bytes, headroom=headroom,
                                          target_batch=target_batch, world_size=world_size, upper=upper,
                                          estimate=estimate, precision=precision,
                                          lengths=None if task.lengths is None else sorted(task.lengths),
                                          savers=savers)
    if cache and not refresh:
        cached = probe_cache.load(fingerprint, cache_dir)
        if cached is not None:
            return cached
    started = time.perf_counter()
    profile = None if task.lengths is None else LengthProfile.of(task.lengths, source=lengths_source)
    library = cuda_library_bytes(device) if estimate and device.type == "cuda" else 0
    passes = steps_per_size if steps_per_size is not None else 2 if is_compiled(task.model) else 1
    measured, tried, weighed = _measure_savers(task, optimizer, precision, plan_budget.budget_bytes - library,
                                               plan_budget.headroom, savers, progress, estimate=estimate,
                                               weigh=weigh_savers,
                                               share=share, smallest=smallest, upper=upper, passes=passes,
                                               max_candidates=max_candidates, profile=profile)
    stepper = measured.stepper
    stepper.warn_if_summed()
    candidates, model_fit, token_model, note = _with_library(measured, library, device)
    plan = Plan.for_target(target_batch, measured.best, world_size, smallest).with_saver(measured.saver)
    if token_model is not None and profile is not None:
        plan = _token_plan(token_model, profile, plan, plan_budget.budget_bytes, plan_budget.headroom, upper,
                           candidates)
    report = ProbeReport(
        plan=plan, candidates=candidates, model=model_fit, device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        meter="fake" if estimate else stepper.meter.kind, is_estimate=estimate,
        budget_bytes=plan_budget.budget_bytes, budget_source=plan_budget.source, headroom=plan_budget.headroom,
        probe_steps=stepper.steps, probe_ooms=stepper.ooms, wall_time_s=time.perf_counter() - started,
        fit_note=note, precision=precision, optimizer_steps=stepper.optimizer_steps, fingerprint=fingerprint,
        token_model=token_model, lengths=profile, savers_tried=tuple(tried), savers_weighed=tuple(weighed),
        model_fingerprint=model_fingerprint(task.model), model_summary=model_summary(task.model),
    )
    if cache:
        probe_cache.store(report, cache_dir)
    return report


def _measure_savers(task: Task, optimizer: Any, precision: Precision, budget_bytes: int, headroom: float,
                    savers: tuple[str, ...], progress: bool, *, estimate: bool, weigh: bool, share: int,
                    smallest: int, upper: int, passes: int, max_candidates: int, profile: LengthProfile | None
                    ) -> tuple[Measured, list[tuple[str, int | None]], list[tuple[str, int, float | None]]]:
    """The measurements with each saver the plan's choice needs (``choose_saver``), the terminal line
    showing them."""
    line = ProbeProgress(progress)
    try:
        def measure(saver: str) -> Measured:
            return _measure(task, optimizer, precision, budget_bytes, headroom, estimate=estimate, share=share,
                            smallest=smallest, upper=upper, passes=passes, max_candidates=max_candidates,
                            profile=profile, saver=saver, progress=line)

        # fake steps take no time, and a token plan is cut by memory: no speed to weigh savers by
        return choose_saver(savers, measure, line, share, smallest,
                            weigh=weigh and not estimate and profile is None)
    finally:
        line.close()


def _with_library(measured: Measured, library: int, device: torch.device
                  ) -> tuple[tuple[Candidate, ...], MemoryModel | None, TokenMemoryModel | None, str]:
    """The candidates, memory models and note, with the bytes the CUDA libraries keep added to every
    peak where an estimate ran on fake CUDA tensors (``library`` > 0)."""
    candidates = tuple(measured.stepper.measured.values())
    model_fit, token_model, note = measured.model, measured.token_model, measured.note
    if not library:
        return candidates, model_fit, token_model, note
    model_fit = None if model_fit is None else dataclasses.replace(
        model_fit, base_bytes=model_fit.base_bytes + library, opt_peak_bytes=model_fit.opt_peak_bytes + library)
    token_model = None if token_model is None else dataclasses.replace(
        token_model, base_bytes=token_model.base_bytes + library, opt_peak_bytes=token_model.opt_peak_bytes + library)
    return (with_offset(candidates, library), model_fit, token_model,
            f"{note}; peaks include {library} bytes the CUDA libraries keep (measured on {device})")


#: a pass's fixed cost, in the share of a full micro-batch's cost, where the probe's timings cannot tell
DEFAULT_PASS_SHARE = 0.1


def pass_cost(candidates: Iterable[Candidate], quadratic: float, max_cost: float, per_sample: float = 0.0) -> float:
    """What a forward/backward pass costs beyond its tokens, in token-units: the intercept over the slope of
    ``time = fixed + per_unit * b * (L + quadratic * L**2 + per_sample)`` through the sizes timed at the longest length,
    kept within 2% and 100% of a full micro-batch (DEFAULT_PASS_SHARE where the timings cannot tell)."""
    timed = [c for c in candidates if c.status == "ok" and c.length is not None and c.micro_step_time_s]
    longest = max((c.length for c in timed), default=None)
    points = [(c.micro_batch * (c.length + quadratic * c.length ** 2 + per_sample), c.micro_step_time_s)
              for c in timed if c.length == longest]
    if len({u for u, _ in points}) < 2:
        return DEFAULT_PASS_SHARE * max_cost
    mean_u = sum(u for u, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = sum((u - mean_u) * (t - mean_t) for u, t in points) / sum((u - mean_u) ** 2 for u, _ in points)
    if slope <= 0:
        return DEFAULT_PASS_SHARE * max_cost
    fixed = mean_t - slope * mean_u
    return min(max(fixed / slope, 0.02 * max_cost), max_cost)


def _token_plan(token_model: TokenMemoryModel, profile: LengthProfile, plan: Plan, budget_bytes: int,
                headroom: float, upper: int, candidates: Iterable[Candidate]) -> Plan:
    """The plan for variable-length data: cut by the token budget the model predicts fits, at most as
    many samples per micro-batch as fit at the shortest length, passes weighed by their measured cost."""
    max_cost = max(token_model.max_cost(budget_bytes, headroom), 1.0)
    tokens = TokenBudget(max_cost, token_model.quadratic, profile.longest,
                         pass_cost(candidates, token_model.quadratic, max_cost, token_model.per_sample),
                         token_model.per_sample)
    cap = min(upper, max(plan.min_micro_batch, tokens.max_batch(profile.shortest)))
    return dataclasses.replace(plan.with_micro_batch(cap), tokens=tokens)


#: the weights are copied on their device for the warm-up only where the room left holds the copy and this many times
#: the trainable bytes besides (gradients, AdamW's two moments, temporaries); otherwise they go to host memory
WARM_UP_ROOM = 4


def _room_for_weights_copy(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device,
                           usable: int) -> bool:
    """Whether a ``WeightsCopy`` of ``model`` fits beside the warm-up (WARM_UP_ROOM)."""
    if not WeightsCopy.usable(model):
        return False
    trainable = sum(p.numel() * p.element_size() for p in trainable_parameters(model))
    need = WeightsCopy.nbytes(model) + WARM_UP_ROOM * trainable
    if device.type == "cuda":
        live = torch.cuda.memory_allocated(device)
        return need <= min(usable, cuda_available_bytes(device)) - live
    counter = TrackedMemory().track(model, optimizer)  # what the probe's counter will start from
    live = counter.current_bytes
    counter.close()
    return need <= usable - live


def _measure(task: Task, optimizer: Any, precision: Precision, budget_bytes: int, headroom: float, *,
             estimate: bool, share: int, smallest: int, upper: int, passes: int, max_candidates: int,
             profile: LengthProfile | None, saver: str = "none", progress: ProbeProgress | None = None) -> Measured:
    """Run the measurements (on fake tensors for an estimate) and choose the size; the task's state is restored
    after both. Where the weights' copy on the device did not do (``HostSnapshotNeeded``), everything is measured
    again with them copied to host memory; the first try's passes and OOMs count in the report."""
    kwargs: dict[str, Any] = {"estimate": estimate, "share": share, "smallest": smallest, "upper": upper,
                              "passes": passes, "max_candidates": max_candidates, "profile": profile, "saver": saver,
                              "progress": progress}
    try:
        return _measure_once(task, optimizer, precision, budget_bytes, headroom, copy_weights=not estimate, **kwargs)
    except HostSnapshotNeeded as first:
        logger.debug("probe: %s; measuring again with the weights copied to host memory", first)
        if progress is not None:
            progress.measuring_with(saver)  # the sizes are measured again
        measured = _measure_once(task, optimizer, precision, budget_bytes, headroom, copy_weights=False, **kwargs)
        measured.stepper.steps += first.steps
        measured.stepper.ooms += first.ooms
        measured.stepper.optimizer_steps += first.optimizer_steps
        return measured


def _weights_copy(model: torch.nn.Module, meter: Any, device: torch.device) -> tuple[WeightsCopy, int]:
    """The weights copied on the device, inside the meter (it counts against the budget as it would on the
    device), and its bytes."""
    before = meter.read().current_bytes
    weights_copy, failed = catch_oom(WeightsCopy, model)
    if failed or weights_copy is None:  # the room was not there after all (fragmentation, another process)
        release_memory(device)
        raise HostSnapshotNeeded("no device memory for the weights' copy")
    return weights_copy, meter.read().current_bytes - before


def _measure_once(task: Task, optimizer: Any, precision: Precision, budget_bytes: int, headroom: float, *,
                  copy_weights: bool, estimate: bool, share: int, smallest: int, upper: int, passes: int,
                  max_candidates: int, profile: LengthProfile | None, saver: str,
                  progress: ProbeProgress | None = None) -> Measured:
    device = trainable_parameters(task.model)[0].device
    run_model, make_optimizer = task.model, task.make_optimizer
    user_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    # the caller's optimizer is not stepped where a StandIn can step for it (autoaccum.probe.passes)
    stand_in = None if estimate or user_optimizer is None else StandIn.of(user_optimizer)
    run_optimizer = user_optimizer if stand_in is None else stand_in.optimizer
    usable = usable_bytes(budget_bytes, headroom)
    copy_weights = copy_weights and _room_for_weights_copy(task.model, run_optimizer, device, usable)
    # an estimate runs on fake copies: of the real state only the generators can change
    snapshot: Any = training_state.capture_rng() if estimate else \
        training_state.capture(task.model, user_optimizer if stand_in is None else None, parameters=not copy_weights)
    weights_copy: WeightsCopy | None = None
    fake_mode: Any = None
    if estimate:  # fake tensors, on the model's CUDA device where torch can, else on cpu (autoaccum.probe.estimate)
        device = estimate_device(device)
        fake_mode, run_model, make_optimizer = fake_setup(task.model, optimizer, make_optimizer, device)
        run_optimizer = None
    meter: Any = CudaMeter(device, budget_bytes) if device.type == "cuda" and not estimate else \
        TrackedMemory(budget_bytes=None if estimate else budget_bytes)
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            if run_optimizer is None:
                run_optimizer = _new_optimizer(make_optimizer, run_model)
            if isinstance(meter, TrackedMemory):
                meter.track(run_model, run_optimizer)
            with meter, apply_saver(run_model, saver):
                weights_copy, copy_bytes = _weights_copy(task.model, meter, device) if copy_weights else (None, 0)
                stepper = Stepper(run_model, run_optimizer, task.loss_fn, task.batch, device, meter, usable,
                                  share=share, passes=passes, autocast_dtype=autocast_dtype(precision),
                                  scaler=None if estimate else make_scaler(precision, device), own_inputs=estimate,
                                  weights_copy=weights_copy, copy_bytes=copy_bytes, progress=progress)
                token_model = None
                if profile is None:
                    model_fit, note = search_sizes(stepper, smallest, upper, budget_bytes, headroom, max_candidates)
                else:
                    token_model, model_fit, note = search_lengths(stepper, profile, smallest, upper, budget_bytes,
                                                                  headroom, max_candidates)
                # Fake steps take no real time, and a token plan is cut by memory: no speed choice there.
                best = max(c.micro_batch for c in stepper.current.values() if c.status == "ok") \
                    if estimate or token_model is not None else choose(stepper, share, smallest)
    finally:
        if weights_copy is not None:
            weights_copy.put_back()  # (done when the warm-up ended, unless it never ran)
        if isinstance(meter, TrackedMemory):
            meter.close()
        if estimate:
            training_state.restore_rng(snapshot)
        else:
            training_state.restore(snapshot, task.model, user_optimizer if stand_in is None else None)
            if stand_in is not None:
                stand_in.put_back()
            del snapshot  # its page-locked host copies go back
            training_state.release_pinned_memory()
    return Measured(stepper, model_fit, token_model, note, best, saver)
