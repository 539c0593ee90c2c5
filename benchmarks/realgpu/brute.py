"""Brute force: the largest micro-batch whose real accumulated training steps fit, found by trying.

A try runs, on the row's model with a fresh AdamW, two optimizer steps of two forward/backward passes
each (the shared hand-written step), under the row's precision. It fits when it ran without an OOM and
its peak (the allocator's on CUDA, the tracked counter on a CPU) stayed under ``budget x (1 - headroom)``.
:func:`brute_around` searches outward from a start (the probe's answer), so a right start costs two tries.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from common import hand_step

from autoaccum import emulated_budget
from autoaccum.memory.recovery import catch_oom
from autoaccum.plan.batch import move_to
from autoaccum.plan.task import LossFn, default_optimizer
from autoaccum.precision import autocast_dtype

from .models import Built
from .squeeze import release

__all__ = ["BruteForce", "Try", "brute_around", "run_try"]


@dataclass(frozen=True)
class Try:
    """One try: did ``micro_batch`` fit, and its peaks (allocated; reserved on CUDA; None where unknown)."""

    micro_batch: int
    fits: bool
    oom: bool
    peak_bytes: int | None
    reserved_peak_bytes: int | None
    seconds: float


@dataclass
class BruteForce:
    """The answer of one search and every try it took, in order."""

    limit: int
    tries: list[Try] = field(default_factory=list)
    capped: bool = False  # stopped at max_tries: ``limit`` is the largest size seen to fit

    def to_dict(self) -> dict[str, Any]:
        return {"limit": self.limit, "capped": self.capped, "tries": [asdict(t) for t in self.tries]}


def run_try(built: Built, loss_fn: LossFn, b: int, device: torch.device, usable_bytes: int, emulate: bool) -> Try:
    """One try at ``b`` (see the module docstring); the optimizer's state, the gradients and the batch are
    gone afterwards."""
    release(device, collect=False)  # the last try's tensors died with it; an OOM's were collected after it
    start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    counter: list[Any] = []

    dtype = autocast_dtype(built.workload.precision)  # type: ignore[arg-type] - a workload's precision

    def attempt() -> None:
        model = built.model
        optimizer = default_optimizer([p for p in model.parameters() if p.requires_grad])
        with emulated_budget(usable_bytes, model, optimizer) if emulate else contextlib.nullcontext() as mem:
            counter.append(mem)
            batch = move_to(built.workload.make_batch(b, b), device)
            for _ in range(2):  # two steps of two passes: the second pass runs with the first one's gradients
                hand_step(model, optimizer, [batch, batch], loss_fn, dtype=dtype)

    started = time.perf_counter()
    _, oom = catch_oom(attempt)
    seconds = time.perf_counter() - started
    built.clear_grads()
    if device.type == "cuda":
        peak, reserved = int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))
    else:
        peak, reserved = (counter[0].peak_bytes if counter and counter[0] is not None else None), None
    # outside the except block; a collection only where memory did not come back (frames in reference cycles)
    release(device, collect=oom or (device.type == "cuda" and torch.cuda.memory_allocated(device) > start))
    fits = not oom and peak is not None and peak <= usable_bytes
    return Try(b, fits, oom, peak, reserved, seconds)


class _Capped(Exception):
    pass


def brute_around(attempt: Callable[[int], Try], start: int, smallest: int, upper: int, max_tries: int) -> BruteForce:
    """The largest size in ``[smallest, upper]`` for which ``attempt`` fits (0 if none), searched from
    ``start``: up (``start + 1``, ``+ 2``, ``+ 4``, ...) while sizes fit, or down (``start - 1``, ``- 2``, ...)
    while they do not, then bisection between the largest size seen to fit and the smallest seen not to.
    The answer ``b`` has been tried, and so has ``b + 1`` (unless ``b`` is ``upper``): a right start costs
    two tries. At most ``max_tries`` tries (then ``capped``, with the largest size seen to fit)."""
    result = BruteForce(0)
    seen: dict[int, bool] = {}

    def fits(b: int) -> bool:
        if b not in seen:
            if len(result.tries) >= max_tries:
                raise _Capped
            result.tries.append(attempt(b))
            seen[b] = result.tries[-1].fits
        return seen[b]

    def best() -> int:
        return max((b for b, ok in seen.items() if ok), default=0)

    b = min(max(start, smallest), upper)
    try:
        step = 1
        if fits(b):
            lo, hi = b, None
            while lo < upper:
                size = min(lo + step, upper)
                if not fits(size):
                    hi = size
                    break
                lo, step = size, 2 * step
        else:
            lo, hi = None, b
            while hi > smallest:
                size = max(hi - step, smallest)
                if fits(size):
                    lo = size
                    break
                hi, step = size, 2 * step
            if lo is None:
                return result  # not even the smallest size fits
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        result.limit = lo
    except _Capped:
        result.limit, result.capped = best(), True
    return result
