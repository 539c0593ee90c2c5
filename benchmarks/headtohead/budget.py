"""The memory budget every system runs under, and its calibration by brute force.

On CPU the budget is autoaccum's emulated device (whose OOM reads like a CUDA one, so the peers'
detectors react to it), recording when each OOM struck; on CUDA the real device made smaller.
"""

from __future__ import annotations

import copy
import gc
import time
from functools import partial
from typing import Any

import torch
from common import HEADROOM_KEPT, hand_step, largest_fitting, micro_batches

from autoaccum import TrackedMemory
from autoaccum.memory.savers import allowed_savers, apply_saver, saver_rank

from .context import Context
from .workloads import loss_sum, make_optimizer, on_device, slice_batch


class EmulatedBudget(TrackedMemory):
    """autoaccum's emulated budget, recording when each OOM struck (for the time lost to recovery).

    Its ``torch.OutOfMemoryError`` is autoaccum's own, unchanged: it reads "CUDA out of memory. Tried
    to allocate ...", the text the peers' detectors look for."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes=budget_bytes)
        self.oom_times: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        ooms = self.oom_count
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            if self.oom_count != ooms:
                self.oom_times.append(time.perf_counter())

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes

    @property
    def ooms(self) -> int:
        return len(self.oom_times)


class CudaBudget:
    """A real CUDA device made smaller with ``set_per_process_memory_fraction`` (GPU runs only)."""

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        self.device = device
        self.total = torch.cuda.get_device_properties(device).total_memory
        self.budget_bytes = budget_bytes
        self._ooms_at_start = 0
        self.oom_times: list[float] = []  # not known on CUDA; ``ooms`` reads the allocator's counter

    def track(self, *objs: Any) -> CudaBudget:
        return self

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        torch.cuda.set_per_process_memory_fraction(min(budget_bytes / self.total, 1.0), self.device)

    def __enter__(self) -> CudaBudget:
        gc.collect()
        torch.cuda.empty_cache()
        self._ooms_at_start = int(torch.cuda.memory_stats(self.device).get("num_ooms", 0))
        self.set_budget(self.budget_bytes)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    @property
    def ooms(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_ooms", 0)) - self._ooms_at_start


def make_budget(budget_bytes: int, device: torch.device) -> EmulatedBudget | CudaBudget:
    return CudaBudget(budget_bytes, device) if device.type == "cuda" else EmulatedBudget(budget_bytes)


def accumulated_steps(ctx: Context, micro: int, budget: Any, steps: int = 2, accumulate: bool = True,
                      saver: str | None = None) -> None:
    """Two AdamW steps of the hand-written step, each accumulating two micro-batches of ``micro`` (one when
    ``micro`` is the target, or without ``accumulate``). The second micro-batch's forward runs with the first
    one's gradients alive: an accumulation step needs more memory than a lone step of the same micro-batch.
    The model runs on ``saver`` of the memory savers (default: the workload's)."""
    target = ctx.workload.target_batch
    model = copy.deepcopy(ctx.base).to(ctx.device)
    optimizer = make_optimizer(model)
    budget.track(model, optimizer)
    parts = 1 if micro >= target or not accumulate else 2
    with budget, apply_saver(model, ctx.workload.saver if saver is None else saver):
        for step in range(steps):
            hand_step(model, optimizer, micro_batches(slice_batch(ctx.data, step * parts * micro,
                                                                  (step + 1) * parts * micro), micro),
                      loss_sum, prepare=partial(on_device, device=ctx.device))


def peak_bytes(ctx: Context, micro: int, saver: str | None = None) -> int:
    if ctx.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        accumulated_steps(ctx, micro, CudaBudget(2**62, ctx.device), saver=saver)  # the fraction stays 1
        return int(torch.cuda.max_memory_reserved(ctx.device))  # the fraction caps reserved memory
    meter = TrackedMemory()
    accumulated_steps(ctx, micro, meter, saver=saver)
    return meter.peak_bytes


def blocks_budget(ctx: Context, share: float) -> tuple[int, str]:
    """A budget at which the workload's ``micro_target`` samples (two accumulated steps, the probe's headroom
    kept free) fit with the first saver that checkpoints at least ``share`` of the blocks, but not with the saver
    below it: midway between their peaks, over ``HEADROOM_KEPT``. Returns the bytes and that saver."""
    savers = allowed_savers(ctx.base, ctx.device, ("checkpointing",))  # none, k of N blocks, all; no offload
    index = next(i for i, s in enumerate(savers) if i and saver_rank(s) >= share)
    micro = ctx.workload.micro_target
    low, high = peak_bytes(ctx, micro, savers[index]), peak_bytes(ctx, micro, savers[index - 1])
    return int((low + high) / 2 / HEADROOM_KEPT), savers[index]


def budget_for(ctx: Context, micro: int) -> int:
    """Bytes in which a plain accumulation loop fits ``micro`` samples but not ``micro + 1``."""
    low, high = peak_bytes(ctx, micro), peak_bytes(ctx, micro + 1)
    return (low + high) // 2 if high > low else low


def fits(ctx: Context, micro: int, budget_bytes: int, accumulate: bool = True, saver: str | None = None) -> bool:
    if ctx.device.type == "cuda":  # the counter of a CPU run sees only its own tensors; a GPU sees all
        gc.collect()
    budget = make_budget(budget_bytes, ctx.device)
    try:
        accumulated_steps(ctx, micro, budget, accumulate=accumulate, saver=saver)
    except torch.OutOfMemoryError:
        return False
    finally:
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return True


def brute_force(ctx: Context, budget_bytes: int, accumulate: bool = True, saver: str | None = None) -> tuple[int, int]:
    """The largest micro-batch that runs two accumulated AdamW steps under the budget (doubling, then
    bisection), and how many sizes were tried; 0 where one sample does not fit. ``accumulate=False``: two
    lone steps of that size. ``saver``: the memory saver the steps run on (default: the workload's)."""
    return largest_fitting(lambda b: fits(ctx, b, budget_bytes, accumulate, saver), ctx.workload.target_batch)
