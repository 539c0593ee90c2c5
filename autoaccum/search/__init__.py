"""Throughput search: the fastest configuration that fits, measured, not just the largest batch.

The probe says which micro-batches fit; this package asks which one -- with which knobs (the memory
memory saver, as the probe and the guard take it: activation checkpointing, or offload on CUDA;
autocast dtype; ``torch.compile``; see ``autoaccum.search.knobs``) -- trains fastest at the exact
global batch: a larger micro-batch with a saver may beat a smaller one without. Each Optuna trial picks a
micro-batch and knobs, runs real guarded optimizer steps (``autoaccum.search.throughput``) and returns
measured samples/s. The winner's plan carries its saver (``Plan.saver``), which ``fit`` and
``OOMGuard`` apply.

- ``space``: what may be tried (``SearchSpace``, the candidate sizes).
- ``knobs``: the knobs and how a trial applies them to the model and undoes them.
- ``throughput``: one trial's guarded steps and their measured samples/s.
- ``study``: the Optuna study (seeds, infeasible trials, patience, the final comparison that picks
  the winner, stored studies and their resumption).
- ``compare``: the final comparison's statistic (paired, with its noise).
- ``result``: ``SearchResult``, its trials and the plan file.

Afterwards the model, optimizer and RNG are bit-identical to before (invariant 4).

Process-wide effects: while the study runs, Optuna's ``FutureWarning`` warnings are ignored through
``warnings.catch_warnings`` (restored on return; the ``warnings`` filters are shared by all
threads of the process). What each trial touches is in ``autoaccum.search.throughput`` and
``autoaccum.search.knobs``. Nothing else outside the model, its optimizer and the study changes.
Optuna is imported only when ``search`` runs (the ``search`` extra).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from autoaccum import state as training_state
from autoaccum.plan.task import LossFn, Task, resolve_task, trainable_parameters
from autoaccum.probe.report import ProbeReport, check_made_for
from autoaccum.probe.run import probe
from autoaccum.search.result import (
    PLAN_FILE_KIND,
    SearchResult,
    TrialRecord,
    format_search,
    load_plan_file,
    read_plan_file,
)
from autoaccum.search.space import SearchSpace, accumulated_fit, candidate_micro_batches, resolve_space
from autoaccum.search.study import SearchError, StudyOptions, require_optuna, run_study
from autoaccum.search.throughput import Clock, make_bench
from autoaccum.units import format_bytes, parse_bytes
from autoaccum.validate import (
    check_fraction,
    check_headroom,
    check_non_negative_int,
    check_positive_float,
    check_positive_int,
)

__all__ = ["SearchSpace", "TrialRecord", "SearchResult", "SearchError", "search", "candidate_micro_batches",
           "load_plan_file", "read_plan_file", "format_search", "require_optuna", "PLAN_FILE_KIND"]


def search(
    task: Task | None = None,
    target_batch: int = 256,
    *,
    model: torch.nn.Module | None = None,
    loss_fn: LossFn | None = None,
    make_batch: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    n_trials: int = 20,
    timeout_s: float | None = None,
    storage: Any = None,
    study_name: str | None = None,
    space: SearchSpace | None = None,
    budget: int | str | None = None,
    headroom: float = 0.1,
    world_size: int = 1,
    warmup_steps: int = 2,
    measure_steps: int = 3,
    patience: int | None = 8,
    min_improvement: float = 0.01,
    seed: int | None = 0,
    confirm_top: int = 3,
    confirm_rounds: int = 5,
    clock: Clock = "wall",
    report: ProbeReport | None = None,
) -> SearchResult:
    """Search micro-batch and knobs for the most samples/s that fit, with an Optuna study.

    Give a ``Task`` or its parts (``model``, ``loss_fn``, ``make_batch``; ``optimizer`` an
    instance, stepped and restored, default a fresh AdamW from the task). Needs the ``search``
    extra (``pip install 'autoaccum[search]'``).

    Args:
        task: the model, loss and batch maker; or None and the next three.
        target_batch: samples per optimizer step over all ranks; every trial covers it exactly.
        model: the module to train (without ``task``).
        loss_fn: ``loss_fn(model, batch)`` -> mean loss or ``(loss_sum, num_items)`` (without ``task``).
        make_batch: ``make_batch(b)`` -> a batch of ``b`` samples (without ``task``).
        optimizer: an optimizer instance, stepped by the trials and restored (default: a fresh AdamW).
        n_trials: most trials this call runs (the probe's pick is the first).
        timeout_s: stop starting trials after this many seconds (None: no limit).
        storage: an Optuna storage or URL (None: in memory). ``sqlite:///autoaccum.db`` resumes
            the study ``study_name`` with its earlier trials.
        study_name: default ``autoaccum-<fingerprint>`` of model, device, budget and target.
        space: what to search (default: ``SearchSpace`` defaults for the model and device).
        budget: a trial is infeasible above ``budget * (1 - headroom)`` (default: what the device
            has free); on every device but CUDA an emulated OOM enforces it.
        headroom: the fraction of the budget kept free.
        world_size: ranks sharing the target; one rank's share is measured.
        warmup_steps: optimizer steps per trial before timing (>= 2).
        measure_steps: optimizer steps per trial that are timed.
        patience: stop after this many trials in a row without a ``min_improvement`` (relative)
            gain in the best samples/s (None: never); the seeds and the sampler's random start
            trials do not count.
        min_improvement: the relative gain in the best samples/s that resets ``patience``.
        seed: the sampler's seed.
        confirm_top: the fastest configurations that go to the final comparison, beside the probe's
            pick and the simplest feasible one (fewest knobs, then fewest passes). There the leader
            has the best median, finalists whose paired ratio to it is within noise (two standard
            errors, at least 1% and at most 10%) tie with it, and the simplest of them wins
            (``autoaccum.search.compare``).
        confirm_rounds: how many more times each finalist is measured, interleaved (0: the best
            single trial wins).
        clock: ``wall`` time, or ``cpu`` time of this process for a CPU shared with busy
            processes (with one intra-op thread; see ``autoaccum.search.throughput.Clock``).
        report: a probe report of this model to start from (default: run ``probe``).

    Returns:
        A ``SearchResult``; ``result.save(path)`` writes a plan file.

    Raises:
        ImportError: Optuna is missing.
        DoesNotFitError: the smallest micro-batch does not fit (from the probe).
        SearchError: no trial fitted.
        ValueError: an argument out of its range, a probe report of another model, or a stored study made
            for another target or space.
        TypeError: an argument of the wrong type.
    """
    optuna = require_optuna()
    started = time.perf_counter()
    task = resolve_task(task, model=model, loss_fn=loss_fn, make_batch=make_batch, caller="search")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}")
    check_headroom(headroom)
    options = StudyOptions(
        target_batch=check_positive_int(target_batch, "target_batch"),
        world_size=check_positive_int(world_size, "world_size"), n_trials=check_positive_int(n_trials, "n_trials"),
        timeout_s=None if timeout_s is None else check_positive_float(
            timeout_s, "timeout_s", hint=" seconds, or None for no limit"),
        storage=storage, study_name=study_name,
        patience=None if patience is None else check_positive_int(patience, "patience"),
        min_improvement=check_fraction(min_improvement, "min_improvement"), seed=seed,
        confirm_top=check_positive_int(confirm_top, "confirm_top"),
        confirm_rounds=check_non_negative_int(confirm_rounds, "confirm_rounds"))
    space = SearchSpace() if space is None else space
    if not isinstance(space, SearchSpace):
        raise TypeError(f"space must be an autoaccum.search.SearchSpace, got {type(space).__name__}")
    report = _probe_report(task, optimizer, report, options, budget, headroom)

    device = trainable_parameters(task.model)[0].device
    share = report.plan.rank_batch(0)
    concrete = resolve_space(space, report, task.model, device, share)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable_parameters(task.model))
    largest = accumulated_fit(report, share, grad_bytes)

    user_state = training_state.capture(task.model, optimizer, pinned=False)  # kept all search long: pageable
    try:
        bench = make_bench(task, optimizer, share, report.usable_bytes, warmup_steps, measure_steps, clock)
        return run_study(optuna, bench, report, concrete, space, options, largest=largest, started=started)
    finally:
        training_state.restore(user_state, task.model, optimizer)


def _probe_report(task: Task, optimizer: torch.optim.Optimizer | None, report: ProbeReport | None,
                  options: StudyOptions, budget: int | str | None, headroom: float) -> ProbeReport:
    """``report``, checked against this search's target and budget, or a fresh probe."""
    if report is None:
        return probe(task, optimizer=optimizer, target_batch=options.target_batch, world_size=options.world_size,
                     budget=budget, headroom=headroom, weigh_savers=False)  # the trials weigh them
    check_made_for(report, task.model, name="report")
    if report.plan.target_batch != options.target_batch or report.plan.world_size != options.world_size:
        raise ValueError(f"the probe report is for {report.plan.describe()}; this search is for target_batch "
                         f"{options.target_batch} x world {options.world_size}. Probe again, or pass matching values.")
    if budget is not None and parse_bytes(budget) != report.budget_bytes:
        raise ValueError(f"budget {budget!r} differs from the probe report's {format_bytes(report.budget_bytes)}; "
                         f"give one of them")
    return report
