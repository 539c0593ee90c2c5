"""The full-batch reference every system's final parameters are compared with."""

from __future__ import annotations

import copy
from functools import partial

from common import hand_step, micro_batches
from torch import nn

from .context import Context
from .workloads import loss_sum, make_optimizer, on_device, slice_batch


def reference(ctx: Context) -> nn.Module:
    """Full-batch training: the hand-written step with one micro-batch of all ``target`` samples (the
    loss sum over the step's items).

    On CUDA the full batch of the ``gpu`` models does not fit even the whole device: there the loss sums
    of chunks are accumulated and divided once by the step's item count (exact, but for BatchNorm)."""
    target = ctx.workload.target_batch
    chunk = target if ctx.device.type != "cuda" else max(ctx.truly_fits, 1)
    model = copy.deepcopy(ctx.base).to(ctx.device)
    optimizer = make_optimizer(model)
    for step in range(ctx.steps):
        hand_step(model, optimizer, micro_batches(slice_batch(ctx.data, step * target, (step + 1) * target), chunk),
                  loss_sum, prepare=partial(on_device, device=ctx.device))
    optimizer.zero_grad(set_to_none=True)
    return model


def param_diff(model: nn.Module | None, ref: nn.Module, init: nn.Module) -> tuple[float, float] | None:
    """(max rel diff to the reference, max diff relative to the reference's update), over tensors."""
    if model is None:
        return None
    rel = upd = 0.0
    for p, r, p0 in zip(model.parameters(), ref.parameters(), init.parameters(), strict=True):
        p, r, p0 = p.detach().cpu().double(), r.detach().cpu().double(), p0.detach().cpu().double()
        diff = (p - r).abs().max().item()
        rel = max(rel, diff / max(r.abs().max().item(), 1e-30))
        upd = max(upd, diff / max((r - p0).abs().max().item(), 1e-30))
    return rel, upd
