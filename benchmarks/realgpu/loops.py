"""fit against the hand-written loop at the same plan: samples/s, side by side in one process.

The hand loop is the benchmarks' shared step (``common.hand_step``: micro-batches moved to the device,
autocast at the row's precision, token-level losses summed and divided once by the step's tokens,
``optimizer.step()``), over host-gathered global batches in a fresh order each epoch, with AdamW at
``fit``'s learning rate and one ``.item()`` a step. Both are timed by the start of each step; a run's rate
leaves out its first two steps. ``rounds`` rounds run both, alternating which goes first; the result is
the median ratio fit / hand with its range.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch
from common import hand_step, micro_batches, quiet

import autoaccum
from autoaccum.plan.batch import batch_size, map_tensors, move_to
from autoaccum.precision import autocast_dtype
from autoaccum.step.losses import default_loss

from .models import Built
from .squeeze import release

__all__ = ["LR", "compare", "hand_loop", "rate", "stamped"]

LR = 1e-4  # both loops: small enough that 30 steps from a random start stay finite in bf16
SKIP = 2  # steps left out at the start of every run


def stamped(calls: list[float]) -> Any:
    """``default_loss`` that records the time of every call in ``calls`` (the guard still counts items)."""
    def loss(model: torch.nn.Module, batch: Any, num_items_in_batch: int | None = None) -> Any:
        calls.append(time.perf_counter())
        return default_loss(model, batch, num_items_in_batch=num_items_in_batch)
    loss.count_items = default_loss.count_items  # type: ignore[attr-defined]
    return loss


def rate(starts: list[float], target: int) -> float | None:
    """Samples/s from the step start times of one run: ``target`` samples a step, the first ``SKIP`` steps
    left out (None with fewer than two steps after them)."""
    steady = starts[SKIP:]
    if len(steady) < 2 or steady[-1] <= steady[0]:
        return None
    return target * (len(steady) - 1) / (steady[-1] - steady[0])


def hand_loop(model: torch.nn.Module, data: Any, target: int, micro: int, steps: int, precision: str,
              device: torch.device, seed: int = 0) -> dict[str, Any]:
    """``steps`` optimizer steps of the hand-written loop (see the module docstring); the step start
    times and the last loss."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    dtype = autocast_dtype(precision)  # type: ignore[arg-type]
    num = batch_size(data)
    per_epoch = num // target
    g = torch.Generator().manual_seed(seed)
    starts: list[float] = []
    loss_value = None
    order = torch.empty(0, dtype=torch.long)
    for step in range(steps):
        if step % per_epoch == 0:
            order = torch.randperm(num, generator=g)
        rows = order[(step % per_epoch) * target:(step % per_epoch + 1) * target]
        batch = map_tensors(data, lambda t: t[rows])
        starts.append(time.perf_counter())
        loss = hand_step(model, optimizer, micro_batches(batch, micro), default_loss,
                         prepare=lambda mb: move_to(mb, device), dtype=dtype)
        loss_value = float(loss)  # one synchronisation a step
    optimizer.zero_grad(set_to_none=True)
    return {"starts": starts, "last_loss": loss_value}


def _timed_fit(built: Built, device: torch.device, report: dict[str, Any], steps: int, budget: int | None,
               headroom: float) -> dict[str, Any]:
    """``steps`` steps of ``fit`` on the probe's plan; the step start times, OOMs and any error."""
    w = built.workload
    calls: list[float] = []
    accum = report["plan"]["accum_steps"]
    error, result = None, None
    with quiet():
        try:
            result = autoaccum.fit(built.model, built.data, w.target_batch, loss_fn=stamped(calls),
                                   plan=autoaccum.ProbeReport.from_dict(report), device=device, budget=budget,
                                   headroom=headroom, max_steps=steps, epochs=None, by_length=False, lr=LR,
                                   precision=w.precision, progress=False, verbose=False)
        except (torch.OutOfMemoryError, autoaccum.AutoAccumError) as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    ooms = None if result is None else result.oom_events
    # a step's first forward is every accum-th call of the loss while no OOM replayed a step
    starts = calls[::accum] if not ooms and error is None else []
    return {"starts": starts, "ooms": ooms, "steps": None if result is None else result.optimizer_steps,
            "error": error, "peak_bytes": None if result is None else result.peak_bytes}


def compare(built: Built, device: torch.device, report: dict[str, Any], rounds: int, budget: int | None,
            headroom: float) -> dict[str, Any]:
    """``rounds`` rounds of the hand loop and fit, alternating which goes first (see the module docstring)."""
    w = built.workload
    plan = report["plan"]
    steps = w.loop_steps
    runs: list[dict[str, Any]] = []
    for i in range(rounds):
        order = ("hand", "fit") if i % 2 == 0 else ("fit", "hand")
        round_: dict[str, Any] = {"order": list(order)}
        for which in order:
            gc.collect()
            release(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if which == "hand":
                torch.manual_seed(i)
                out = hand_loop(built.model, built.data, w.target_batch, plan["micro_batch"], steps, w.precision,
                                device, seed=i)
            else:
                out = _timed_fit(built, device, report, steps, budget, headroom)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
                out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
            out["rate"] = rate(out.pop("starts"), w.target_batch)
            round_[which] = out
        hand, fit = round_["hand"]["rate"], round_["fit"]["rate"]
        round_["ratio"] = fit / hand if hand and fit else None
        runs.append(round_)
    built.clear_grads()
    release(device)
    ratios = [r["ratio"] for r in runs if r["ratio"] is not None]
    fits = [r["fit"] for r in runs]
    return {
        "micro_batch": plan["micro_batch"], "accum_steps": plan["accum_steps"], "steps": steps, "rounds": rounds,
        "skip": SKIP, "runs": runs, "ratio": statistics.median(ratios) if ratios else None,
        "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
        "fit_samples_per_s": statistics.median([r["fit"]["rate"] for r in runs if r["fit"]["rate"]] or [0.0]),
        "hand_samples_per_s": statistics.median([r["hand"]["rate"] for r in runs if r["hand"]["rate"]] or [0.0]),
        "fit_ooms": sum(f["ooms"] or 0 for f in fits), "fit_steps": sum(f["steps"] or 0 for f in fits),
        "fit_errors": [f["error"] for f in fits if f["error"]],
        "fit_peak_bytes": max((f["peak_bytes"] or 0 for f in fits), default=None),
    }
