"""hand: the loop one writes by hand (``common.hand_step``) at a fixed micro-batch, with no OOM handling, on
the workload's memory saver. As a system, with nanoGPT's ``loss / accum_steps``; ``savers`` runs it token-exact."""

from __future__ import annotations

import copy
from typing import Any

import torch
from common import hand_step, micro_batches
from torch import nn

from autoaccum.memory.savers import apply_saver

from ..context import Context, RunResult
from ..recorder import Recorder
from ..workloads import loss_sum, make_optimizer, on_device, slice_batch


def start(ctx: Context, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh copy of the seeded model and its AdamW, watched by ``recorder``; training starts now."""
    model = recorder.watch_model(copy.deepcopy(ctx.base).to(ctx.device))
    optimizer = make_optimizer(model)
    recorder.watch_optimizer(optimizer)
    recorder.phase = "train"
    recorder.new_attempt()
    return model, optimizer


def train(ctx: Context, recorder: Recorder, budget: Any, saver: str, micro: int, mean: bool = False) -> nn.Module:
    """``ctx.steps`` steps of the hand-written loop at ``micro`` on ``saver`` under ``budget``; the model. Token-exact,
    or with ``mean`` nanoGPT's ``loss / accum_steps`` over each micro-batch's token mean (not exact)."""
    model, optimizer = start(ctx, recorder)
    target = ctx.workload.target_batch

    def loss(model: nn.Module, batch: Any) -> Any:
        recorder.forward(batch)
        total, count = loss_sum(model, on_device(batch, ctx.device))
        return total / count if mean else (total, count)

    budget.track(model, optimizer)
    with budget, apply_saver(model, saver):
        for step in range(ctx.steps):
            hand_step(model, optimizer, micro_batches(slice_batch(ctx.data, step * target, (step + 1) * target),
                                                      micro), loss, divide="accum_steps" if mean else "share")
        optimizer.zero_grad(set_to_none=True)
    return model


def run(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    """nanoGPT's ``loss / accum_steps`` at the micro-batch an informed user would fix."""
    target = ctx.workload.target_batch
    micro = max(m for m in (2 ** k for k in range(20)) if m <= ctx.truly_fits and target % m == 0)
    result = RunResult(micro_batch=micro, find_steps=0, find_time_s=0.0, find_ooms=0, saver=ctx.workload.saver)
    try:
        result.model = train(ctx, recorder, budget, ctx.workload.saver, micro, mean=True)
    except torch.OutOfMemoryError as exc:
        result.error = f"crashed: {type(exc).__name__}: {str(exc)[:60]}"
    result.notes.append(f"micro {micro} x accum {target // micro} fixed (largest power of two that fits and divides "
                        f"{target}); no OOM handling" + ("" if ctx.workload.saver == "none" else
                                                         f"; {ctx.workload.saver} on"))
    return result
