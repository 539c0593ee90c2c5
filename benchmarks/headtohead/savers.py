"""Where one sample does not fit: ``fit`` with nothing configured against hand-configured runs, alternating
in one process.

- ``fit``: ``autoaccum.fit(..., budget=...)``, nothing else configured: its probe turns to the memory savers
  and weighs them; on a CPU it trains under its own emulated budget, so an OOM in training would be real.
- a hand-configured run: a memory saver on, a micro-batch whose steps fit with the probe's headroom kept free
  (brute force on fresh models), the benchmarks' hand-written loop (``systems.hand``, token-exact).

``measure``: against ``hand``, the workload's saver (all blocks) at the largest micro-batch; ``every_pair``
(``gpt_blocks``): also against every other pair the brute force finds, each saver from none to all blocks
checkpointed at its largest micro-batch (and that many passes cut evenly), then one negative control, the
hand loop's ``loss / accum_steps``.

Odd rounds run in reverse order. All are timed by the same ``Recorder`` (optimizer steps after the first)
and compared with the same full-batch reference.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from typing import Any

import torch
from common import HEADROOM_KEPT, quiet

import autoaccum
from autoaccum.memory.savers import allowed_savers

from .budget import brute_force, make_budget
from .context import Context, RunResult
from .recorder import Recorder
from .reference import reference
from .report import summarise
from .systems.autoaccum_system import GlobalBatchIterable
from .systems.common import pair_loss
from .systems.hand import start, train

#: the names a child process is started with to run these comparisons (``compare.py --child``)
PAIR, BLOCKS = "fit_vs_hand", "fit_vs_brute_force"

Run = tuple[str, str, int]  # ``fit``, ``hand`` or ``control`` (loss / accum_steps); the hand loop's saver, micro


def run_fit(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    """``fit`` with the budget and no plan: the probe (inside fit) picks the saver and the plan."""
    model, optimizer = start(ctx, recorder)
    target = ctx.workload.target_batch
    # On a CPU fit emulates the budget itself (budget=); on CUDA the card is made smaller around it.
    with budget if ctx.device.type == "cuda" else contextlib.nullcontext():
        fitted = autoaccum.fit(model, GlobalBatchIterable(ctx.data, target, ctx.steps), target,
                               loss_fn=pair_loss(recorder, ctx.device), optimizer=optimizer, budget=ctx.budget_bytes,
                               max_steps=ctx.steps, epochs=None, device=ctx.device, progress=False, verbose=False)
    probe, plan = fitted.probe, fitted.plan
    result = RunResult(micro_batch=fitted.final_plan.micro_batch, planned_micro=plan.micro_batch,
                       find_steps=probe.probe_steps if probe else 0, find_time_s=fitted.probe_time_s,
                       find_ooms=probe.probe_ooms if probe else 0, train_ooms=fitted.oom_events, model=model,
                       saver=fitted.final_plan.saver, planned_saver=plan.saver,
                       weighed=list(probe.savers_weighed) if probe else [])
    # the bytes a saver below needed are counted up to its OOM: a lower bound (DoesNotFitError.at_least)
    result.notes.append(f"plan {plan.describe()}; " + "; ".join(
        f"{saver}: one sample did not fit (>= {autoaccum.format_bytes(needed) if needed else '?'})"
        for saver, needed in (probe.savers_tried if probe else ())))
    return result


def _timed(ctx: Context, run: Run) -> RunResult:
    """One run (``fit``, or the hand loop on a saver at a micro-batch) with its own budget and recorder."""
    variant, saver, micro = run
    budget = make_budget(ctx.budget_bytes, ctx.device)
    recorder = Recorder(budget)
    gc.collect()
    torch.manual_seed(0)
    started = time.perf_counter()
    try:
        result = run_fit(ctx, recorder, budget) if variant == "fit" else RunResult(
            micro_batch=micro, find_steps=0, find_time_s=0.0, find_ooms=0, saver=saver,
            model=train(ctx, recorder, budget, saver, micro, mean=variant == "control"))
    except Exception as exc:  # reported in the row, as the runner reports a system's failure
        result = RunResult(error=f"failed: {type(exc).__name__}: {str(exc)[:100]}")
    result.recorder, result.wall_s = recorder, time.perf_counter() - started
    # fit on a CPU runs under its own emulated budget, not this one: there its OOMs are the guard's count
    result.budget_ooms = result.train_ooms if variant == "fit" and ctx.device.type != "cuda" else budget.ooms
    return result


def _rounds(ctx: Context, rounds: int, runs: dict[str, Run], ref: Any) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` of every run in ``runs``, in order, odd rounds reversed; each run's summary rows."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for index in range(rounds):
        for name in list(runs) if index % 2 == 0 else list(reversed(runs)):
            with quiet():
                rows[name].append(summarise(_timed(ctx, runs[name]), ref, ctx.base, ctx.workload.target_batch))
    return rows


def _median(values: list[Any]) -> Any:
    return statistics.median(values) if values else None


def _ratios(rows: dict[str, list[dict[str, Any]]], other: str, prefix: str = "") -> dict[str, Any]:
    """fit / ``other``, round by round, by wall and by CPU time, and their medians."""
    out: dict[str, Any] = {}
    for clock, key in (("", "samples_per_s"), ("cpu_", "samples_per_cpu_s")):
        paired = [f[key] / h[key] for f, h in zip(rows["fit"], rows[other], strict=True) if f[key] and h[key]]
        out.update({f"{clock}{prefix}ratio_median": _median(paired), f"{clock}{prefix}ratios": paired})
    return out


def _rates(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's median samples/s by wall and by CPU time, and its largest rel. diff to the reference."""
    def of(key: str) -> list[Any]:
        return [r[key] for r in rows if r[key] is not None]
    return {"samples_per_s": _median(of("samples_per_s")), "samples_per_cpu_s": _median(of("samples_per_cpu_s")),
            "max_rel_diff": max(of("max_rel_diff"), default=None), "train_ooms": sum(r["train_ooms"] for r in rows)}


def measure(ctx: Context, rounds: int, every_pair: bool = False) -> dict[str, Any]:
    """``rounds`` runs of ``fit``, of ``hand`` and (``every_pair``) of every other pair the brute force finds,
    alternating; the JSON document."""
    if ctx.workload.saver == "none":
        raise ValueError(f"workload {ctx.workload.name!r} fits one sample without a memory saver: no saver to turn to")
    ref, target, started = reference(ctx), ctx.workload.target_batch, time.perf_counter()
    savers = allowed_savers(ctx.base, ctx.device, ("checkpointing",)) if every_pair else (ctx.workload.saver,)
    largest = {s: brute_force(ctx, int(ctx.budget_bytes * HEADROOM_KEPT), saver=s) for s in savers}
    brute_s, (micro, tried) = time.perf_counter() - started, largest[ctx.workload.saver]
    pairs: dict[str, Run] = {"hand": ("hand", ctx.workload.saver, micro)}
    for saver, (m, _) in largest.items() if every_pair else ():  # the largest micro-batch, its passes cut evenly
        for b in sorted({m, math.ceil(target / math.ceil(target / m))} if m else (), reverse=True):
            pairs.setdefault("hand" if (saver, b) == pairs["hand"][1:] else f"{saver} x {b}", ("hand", saver, b))
    runs = _rounds(ctx, rounds, {"fit": ("fit", "", 0), **pairs}, ref)
    rates = {name: _rates(rows) for name, rows in runs.items()}
    best = max(pairs, key=lambda p: rates[p]["samples_per_s"] or 0.0)
    with quiet():  # the negative control: micro-batches of one, all blocks checkpointed, loss / accum_steps
        control = summarise(_timed(ctx, ("control", "checkpointing", 1)), ref, ctx.base, target) if every_pair else {}
    fits = [r for r in runs["fit"] if r["samples_per_s"]]
    return {"rounds": rounds, "headroom_kept": HEADROOM_KEPT, "hand_micro": micro, "hand_brute_force_s": brute_s,
            "hand_brute_force_sizes_tried": tried, "largest_micro": largest, "runs": runs, "best": best,
            **_ratios(runs, "hand"), **_ratios(runs, best, "best_"),
            **{f"{name}_{key}": value for name in ("fit", "hand") for key, value in rates[name].items()},
            "pairs": {name: {"saver": run[1], "micro": run[2], **rates[name]} for name, run in pairs.items()},
            "best_over_hand": (rates[best]["samples_per_s"] or 0) / (rates["hand"]["samples_per_s"] or math.inf),
            # (saver, micro-batch) planned and at the end, of each run
            "fit_plans": sorted({(r["planned_saver"], r["planned_micro_batch"], r["saver"], r["micro_batch"])
                                 for r in fits}),
            # the probe's wall time over the step time of fit's own plan (target / its samples per second)
            "probe_steps_equivalent": _median([r["find_time_s"] * r["samples_per_s"] / target for r in fits]),
            "probe_passes": _median([r["find_steps"] for r in fits]),
            "control_max_rel_diff": control.get("max_rel_diff"), "control_error": control.get("error")}
