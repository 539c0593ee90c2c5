"""Where one sample does not fit: ``fit`` with nothing configured against a hand-configured run, the two
alternating in one process.

- ``fit``: ``autoaccum.fit(..., budget=...)``, no plan, micro-batch or memory saver given. Its probe finds
  that the smallest micro-batch does not fit, turns to the memory savers and plans with the lowest saver where it
  does; on a CPU the training runs under fit's own emulated budget of that size, so an OOM in training
  would be real.
- ``hand``: what a user would configure by hand: the workload's saver on (``apply_saver``), the largest
  micro-batch whose steps fit with the probe's headroom kept free (brute force on fresh models), and the
  benchmarks' hand-written loop at that micro-batch (``common.hand_step``: token-exact).

Rounds alternate which of the two goes first. Both are timed by the same ``Recorder`` (optimizer steps
after the first), and both are compared with the same full-batch reference.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from typing import Any

import torch
from common import HEADROOM_KEPT, hand_step, micro_batches, quiet

import autoaccum
from autoaccum.memory.savers import apply_saver

from .budget import brute_force, make_budget
from .context import Context, RunResult
from .recorder import Recorder
from .reference import reference
from .report import summarise
from .systems.autoaccum_system import GlobalBatchIterable
from .systems.common import pair_loss
from .workloads import make_optimizer, slice_batch

#: the name a child process is started with to run this comparison (``compare.py --child``)
PAIR = "fit_vs_hand"


def _start(ctx: Context, recorder: Recorder) -> tuple[Any, Any]:
    """A fresh copy of the seeded model and its AdamW, watched by ``recorder``; training starts now."""
    model = recorder.watch_model(copy.deepcopy(ctx.base).to(ctx.device))
    optimizer = make_optimizer(model)
    recorder.watch_optimizer(optimizer)
    recorder.phase = "train"
    recorder.new_attempt()
    return model, optimizer


def run_fit(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    """``fit`` with the budget and no plan: the probe (inside fit) picks the saver and the plan."""
    model, optimizer = _start(ctx, recorder)
    target = ctx.workload.target_batch
    # On a CPU fit emulates the budget itself (budget=); on CUDA the card is made smaller around it.
    outer = budget if ctx.device.type == "cuda" else contextlib.nullcontext()
    with outer:
        fitted = autoaccum.fit(model, GlobalBatchIterable(ctx.data, target, ctx.steps), target,
                               loss_fn=pair_loss(recorder, ctx.device), optimizer=optimizer, budget=ctx.budget_bytes,
                               max_steps=ctx.steps, epochs=None, device=ctx.device, progress=False, verbose=False)
    probe = fitted.probe
    result = RunResult(micro_batch=fitted.final_plan.micro_batch, planned_micro=fitted.plan.micro_batch,
                       find_steps=probe.probe_steps if probe else 0, find_time_s=fitted.probe_time_s,
                       find_ooms=probe.probe_ooms if probe else 0, train_ooms=fitted.oom_events, model=model,
                       saver=fitted.final_plan.saver)
    tried = probe.savers_tried if probe else ()
    # the bytes a saver below needed are counted up to its OOM: a lower bound (DoesNotFitError.at_least)
    result.notes.append(f"plan {fitted.plan.describe()}; " + "; ".join(
        f"{saver}: one sample did not fit (>= {autoaccum.format_bytes(needed) if needed else '?'})"
        for saver, needed in tried))
    return result


def run_hand(ctx: Context, recorder: Recorder, budget: Any, micro: int) -> RunResult:
    """The hand-written loop at ``micro`` on the workload's saver, token-exact, under ``budget``."""
    model, optimizer = _start(ctx, recorder)
    target = ctx.workload.target_batch
    loss = pair_loss(recorder, ctx.device)
    budget.track(model, optimizer)
    with budget, apply_saver(model, ctx.workload.saver):
        for step in range(ctx.steps):
            hand_step(model, optimizer, micro_batches(slice_batch(ctx.data, step * target, (step + 1) * target),
                                                      micro), loss)
        optimizer.zero_grad(set_to_none=True)
    return RunResult(micro_batch=micro, find_steps=0, find_time_s=0.0, find_ooms=0, model=model,
                     saver=ctx.workload.saver)


def _timed(ctx: Context, variant: str, micro: int) -> RunResult:
    """One run of ``variant`` (``fit`` or ``hand``) with its own budget and recorder."""
    budget = make_budget(ctx.budget_bytes, ctx.device)
    recorder = Recorder(budget)
    gc.collect()
    torch.manual_seed(0)
    started = time.perf_counter()
    try:
        result = run_fit(ctx, recorder, budget) if variant == "fit" else run_hand(ctx, recorder, budget, micro)
    except Exception as exc:  # reported in the row, as the runner reports a system's failure
        result = RunResult(error=f"failed: {type(exc).__name__}: {str(exc)[:100]}")
    result.recorder, result.wall_s = recorder, time.perf_counter() - started
    # fit on a CPU runs under its own emulated budget, not this one: there its OOMs are the guard's count
    own = variant == "fit" and ctx.device.type != "cuda"
    result.budget_ooms = result.train_ooms if own else budget.ooms
    return result


def measure(ctx: Context, rounds: int) -> dict[str, Any]:
    """``rounds`` runs of ``fit`` and of ``hand``, alternating (odd rounds hand first); the JSON document."""
    if ctx.workload.saver == "none":
        raise ValueError(f"workload {ctx.workload.name!r} fits one sample without a memory saver: no saver to turn to")
    ref = reference(ctx)
    started = time.perf_counter()
    micro, tried = brute_force(ctx, int(ctx.budget_bytes * HEADROOM_KEPT))
    brute_s = time.perf_counter() - started
    runs: dict[str, list[dict[str, Any]]] = {"fit": [], "hand": []}
    for index in range(rounds):
        for variant in ("fit", "hand") if index % 2 == 0 else ("hand", "fit"):
            with quiet():
                row = summarise(_timed(ctx, variant, micro), ref, ctx.base, ctx.workload.target_batch)
            runs[variant].append(row)

    def paired(key: str) -> list[float]:  # fit / hand, round by round
        return [f[key] / h[key] for f, h in zip(runs["fit"], runs["hand"], strict=True) if f[key] and h[key]]

    def of(variant: str, key: str) -> list[Any]:
        return [r[key] for r in runs[variant] if r[key] is not None]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    wall, cpu = paired("samples_per_s"), paired("samples_per_cpu_s")
    return {
        "rounds": rounds, "headroom_kept": HEADROOM_KEPT, "hand_micro": micro, "hand_brute_force_sizes_tried": tried,
        "hand_brute_force_s": brute_s, "runs": runs,
        **{f"{v}_{key}": median(of(v, key)) for v in ("fit", "hand") for key in ("samples_per_s", "samples_per_cpu_s")},
        "ratio_median": median(wall), "ratios": wall, "cpu_ratio_median": median(cpu), "cpu_ratios": cpu,
        "fit_train_ooms": sum(r["train_ooms"] or 0 for r in runs["fit"]),
        **{f"{v}_max_rel_diff": max(of(v, "max_rel_diff"), default=None) for v in ("fit", "hand")},
    }
