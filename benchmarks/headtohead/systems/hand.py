"""hand: a nanoGPT-style loop (``loss / accum_steps``) with a fixed micro-batch and no OOM handling; on the
workload's memory saver (checkpointing on, where one sample does not fit without it)."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import torch
from common import hand_step, micro_batches

from autoaccum.memory.savers import apply_saver

from ..context import Context, RunResult
from ..recorder import Recorder
from ..workloads import make_optimizer, on_device, slice_batch
from .common import mean_loss


def run(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    """The hand-written step with nanoGPT's ``loss / accum_steps``; a fixed micro-batch chosen by an informed
    user."""
    target = ctx.workload.target_batch
    micro = max(m for m in (2 ** k for k in range(20)) if m <= ctx.truly_fits and target % m == 0)
    accum = target // micro
    model = recorder.watch_model(copy.deepcopy(ctx.base).to(ctx.device))
    optimizer = make_optimizer(model)
    recorder.watch_optimizer(optimizer)
    loss_fn = mean_loss(recorder)
    recorder.phase = "train"
    recorder.new_attempt()
    budget.track(model, optimizer)
    result = RunResult(micro_batch=micro, find_steps=0, find_time_s=0.0, find_ooms=0, model=model,
                       saver=ctx.workload.saver)
    try:
        with budget, apply_saver(model, ctx.workload.saver):
            for step in range(ctx.steps):
                hand_step(model, optimizer, micro_batches(slice_batch(ctx.data, step * target, (step + 1) * target),
                                                          micro), loss_fn, divide="accum_steps",
                          prepare=partial(on_device, device=ctx.device))
            optimizer.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError as exc:
        result.error = f"crashed: {type(exc).__name__}: {str(exc)[:60]}"
    result.notes.append(f"micro {micro} x accum {accum} fixed (largest power of two that fits and divides "
                        f"{target}); no OOM handling" + ("" if ctx.workload.saver == "none" else
                                                         f"; {ctx.workload.saver} on"))
    return result
