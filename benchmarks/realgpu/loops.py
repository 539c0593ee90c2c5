"""fit against a hand-written loop at the same plan: samples/s, side by side in one process.

The hand loop is the plain accumulation loop (host-gathered global batches in a fresh order each epoch,
micro-batches moved to the device, autocast at the row's precision, losses scaled as ``fit`` scales them,
``optimizer.step()``, one ``.item()`` a step) with AdamW at ``fit``'s learning rate. Both are timed by the
start of each step's first forward; a run's rate leaves out its first two steps. ``rounds`` rounds run
both, alternating which goes first; the result is the median ratio fit / hand with its range.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

import autoaccum
from autoaccum.plan.batch import batch_size, map_tensors, move_to
from autoaccum.precision import autocast, autocast_dtype
from autoaccum.step.losses import default_loss

from .models import Built, fresh_model
from .squeeze import release

__all__ = ["LR", "Stamped", "compare", "hand_loop", "rate"]

LR = 1e-4  # both loops: small enough that 30 steps from a random start stay finite in bf16
SKIP = 2  # steps left out at the start of every run


class Stamped:
    """``loss_fn`` that records the time of every call (and still counts items for the guard)."""

    def __init__(self, loss_fn: Any = default_loss) -> None:
        self.loss_fn, self.calls = loss_fn, []

    def __call__(self, model: torch.nn.Module, batch: Any, num_items_in_batch: int | None = None) -> Any:
        self.calls.append(time.perf_counter())
        if num_items_in_batch is None:
            return self.loss_fn(model, batch)
        return self.loss_fn(model, batch, num_items_in_batch=num_items_in_batch)

    def count_items(self, model: torch.nn.Module, batch: Any) -> int | None:
        return self.loss_fn.count_items(model, batch)


def rate(starts: list[float], target: int) -> float | None:
    """Samples/s from the step start times of one run: ``target`` samples a step, the first ``SKIP`` steps
    left out (None with fewer than two steps after them)."""
    steady = starts[SKIP:]
    if len(steady) < 2 or steady[-1] <= steady[0]:
        return None
    return target * (len(steady) - 1) / (steady[-1] - steady[0])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_loop(model: torch.nn.Module, data: Any, target: int, micro: int, steps: int, precision: str,
              device: torch.device, seed: int = 0) -> dict[str, Any]:
    """``steps`` optimizer steps of the plain accumulation loop (see the module docstring); the step start
    times and the last loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
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
        items = default_loss.count_items(model, batch)  # the step's predicted tokens (None: a per-sample loss)
        optimizer.zero_grad(set_to_none=True)
        for first in range(0, target, micro):
            mb = move_to(map_tensors(batch, lambda t: t[first:first + micro]), device)
            if first == 0:
                starts.append(time.perf_counter())
            with autocast(device, dtype):
                if items is not None:
                    loss = model(**mb, num_items_in_batch=items).loss
                elif isinstance(mb, Mapping):
                    loss = model(**mb).loss * (batch_size(mb) / target)
                else:
                    inputs, targets = mb
                    loss = F.cross_entropy(model(inputs), targets) * (batch_size(mb) / target)
            loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())  # the step's last micro-batch loss: one synchronisation a step
    optimizer.zero_grad(set_to_none=True)
    return {"starts": starts, "last_loss": loss_value}


def _timed_fit(built: Built, device: torch.device, report: dict[str, Any], steps: int, budget: int | None,
               headroom: float) -> dict[str, Any]:
    """``steps`` steps of ``fit`` on the probe's plan; the step start times, OOMs and any error."""
    w = built.workload
    stamped = Stamped()
    accum = report["plan"]["accum_steps"]
    error, result = None, None
    with warnings_quiet():
        try:
            result = autoaccum.fit(fresh_model(built, device), built.data, w.target_batch, loss_fn=stamped,
                                   plan=autoaccum.ProbeReport.from_dict(report), device=device, budget=budget,
                                   headroom=headroom, max_steps=steps, epochs=None, by_length=False, lr=LR,
                                   precision=w.precision, progress=False, verbose=False)
        except (torch.OutOfMemoryError, autoaccum.AutoAccumError) as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    ooms = None if result is None else result.oom_events
    # a step's first forward is every accum-th call of the loss while no OOM replayed a step
    starts = stamped.calls[::accum] if not ooms and error is None else []
    return {"starts": starts, "ooms": ooms, "steps": None if result is None else result.optimizer_steps,
            "error": error, "peak_bytes": None if result is None else result.peak_bytes}


def warnings_quiet() -> contextlib.AbstractContextManager[Any]:
    import warnings

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


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
                out = hand_loop(fresh_model(built, device), built.data, w.target_batch, plan["micro_batch"], steps,
                                w.precision, device, seed=i)
            else:
                out = _timed_fit(built, device, report, steps, budget, headroom)
            _sync(device)
            out["rate"] = rate(out.pop("starts"), w.target_batch)
            if device.type == "cuda":
                out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
                out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
            round_[which] = out
        hand, fit = round_["hand"]["rate"], round_["fit"]["rate"]
        round_["ratio"] = fit / hand if hand and fit else None
        runs.append(round_)
    if built.workload.on_device:
        for p in built.base.parameters():
            p.grad = None
    release(device)
    ratios = [r["ratio"] for r in runs if r["ratio"] is not None]
    fits = [r["fit"] for r in runs]
    return {
        "micro_batch": plan["micro_batch"], "accum_steps": plan["accum_steps"], "steps": steps, "rounds": rounds,
        "skip": SKIP, "runs": runs,
        "ratio": statistics.median(ratios) if ratios else None,
        "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
        "fit_samples_per_s": statistics.median([r["fit"]["rate"] for r in runs if r["fit"]["rate"]] or [0.0]),
        "hand_samples_per_s": statistics.median([r["hand"]["rate"] for r in runs if r["hand"]["rate"]] or [0.0]),
        "fit_ooms": sum(f["ooms"] or 0 for f in fits), "fit_steps": sum(f["steps"] or 0 for f in fits),
        "fit_errors": [f["error"] for f in fits if f["error"]],
    }
