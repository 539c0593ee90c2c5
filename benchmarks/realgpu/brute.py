"""Brute force: the largest micro-batch whose real accumulated training steps fit, found by trying.

A try runs, on a fresh copy of the model with a fresh AdamW (the probe's default optimizer), two
optimizer steps, each of two forward/backward passes of ``b`` samples summed into the gradients (the
second runs with the first's gradients held, as every later micro-batch of an accumulation step does),
then the optimizer step. It fits when it ran without an OOM and its peak stayed under the usable budget
(``budget x (1 - headroom)``, the bytes the probe plans for): on CUDA the allocator's peak of allocated
bytes (the probe's meter), on the CPU the tracked counter, which raises the OOM itself. Before each try
the previous one's memory is released (a collection, ``empty_cache``) and the peak statistics reset.

The search doubles from the smallest size the model trains at, bisects, then checks the answer again
at ``b`` and ``b + 1``; it stops after ``max_tries`` tries (and says so).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autoaccum import emulated_budget
from autoaccum.batch import move_to
from autoaccum.recovery import catch_oom
from autoaccum.task import LossFn, check_loss, default_optimizer

from .models import Built, fresh_model
from .squeeze import release

__all__ = ["BruteForce", "Try", "brute_force", "run_try"]


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
    confirmed: bool = True  # the final check at b and b + 1 agreed with the search

    def to_dict(self) -> dict[str, Any]:
        return {"limit": self.limit, "capped": self.capped, "confirmed": self.confirmed,
                "tries": [asdict(t) for t in self.tries]}


def accumulated_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, batch: Any,
                      steps: int = 2, passes: int = 2) -> None:
    """``steps`` optimizer steps of ``passes`` forward/backward passes each, summed into the gradients."""
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(passes):
            loss, items = check_loss(loss_fn(model, batch))
            (loss / passes if items is None else loss / items / passes).backward()
            del loss
        optimizer.step()


def run_try(built: Built, loss_fn: LossFn, b: int, device: torch.device, usable_bytes: int, emulate: bool) -> Try:
    """One try at ``b`` (see the module docstring); the model, its state and the batch are gone afterwards."""
    release(device, collect=False)  # the last try's tensors died with it; an OOM's were collected after it
    start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    counter: list[Any] = []

    def attempt() -> None:
        model = fresh_model(built, device)
        optimizer = default_optimizer(model.parameters())
        if emulate:
            with emulated_budget(usable_bytes, model, optimizer) as mem:
                counter.append(mem)
                accumulated_steps(model, optimizer, loss_fn, move_to(built.workload.make_batch(b, b), device))
        else:
            accumulated_steps(model, optimizer, loss_fn, move_to(built.workload.make_batch(b, b), device))

    started = time.perf_counter()
    _, oom = catch_oom(attempt)
    seconds = time.perf_counter() - started
    if device.type == "cuda":
        peak, reserved = int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))
    else:
        peak, reserved = (counter[0].peak_bytes if counter else None), None
    # outside the except block; a collection only where memory did not come back (frames in reference cycles)
    release(device, collect=oom or (device.type == "cuda" and torch.cuda.memory_allocated(device) > start))
    fits = not oom and peak is not None and peak <= usable_bytes
    return Try(b, fits, oom, peak, reserved, seconds)


class _Capped(Exception):
    pass


def brute_force(attempt: Callable[[int], Try], smallest: int, upper: int, max_tries: int) -> BruteForce:
    """The largest size in ``[smallest, upper]`` for which ``attempt`` fits (0 if none), by doubling from
    ``smallest``, bisection, and a final check at ``b`` and ``b + 1``; at most ``max_tries`` tries."""
    result = BruteForce(0)

    def fits(b: int) -> bool:
        if len(result.tries) >= max_tries:
            raise _Capped
        result.tries.append(attempt(b))
        return result.tries[-1].fits

    lo = 0
    try:
        if not fits(smallest):
            return result
        lo, hi = smallest, None
        while hi is None and lo < upper:
            size = min(2 * lo, upper)
            lo, hi = (size, None) if fits(size) else (lo, size)
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        result.limit = lo
        result.confirmed = fits(lo) and (lo >= upper or not fits(lo + 1))
    except _Capped:
        result.limit, result.capped = lo, True
    return result
