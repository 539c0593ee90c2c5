"""autoaccum inside an Accelerate loop: ``guard_for(accelerator, model, optimizer)`` after
``accelerator.prepare``, ``guard.accumulate(batch, loss_fn)`` in place of ``accelerator.accumulate`` +
``accelerator.backward``, and Accelerate's own ``optimizer.step()`` / ``zero_grad()``; the loader yields
global batches (examples/accelerate_loop.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..context import Context, RunResult
from ..recorder import Recorder
from ..workloads import make_optimizer
from .common import GlobalRows, batched, guard_outcome, pair_loss, record_probe


def run(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    from accelerate import Accelerator

    from autoaccum.integrations.accelerate import guard_for

    target = ctx.workload.target_batch
    result = RunResult()
    accelerator = Accelerator(cpu=ctx.device.type == "cpu")
    model = recorder.watch_model(copy.deepcopy(ctx.base))
    optimizer = make_optimizer(model)
    recorder.watch_optimizer(optimizer)
    loader = torch.utils.data.DataLoader(GlobalRows(ctx.data), batch_size=target, shuffle=False, collate_fn=batched)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    guard = guard_for(accelerator, model, optimizer)
    record_probe(guard, recorder, result)
    loss_fn = pair_loss(recorder, ctx.device)
    result.model = accelerator.unwrap_model(model)
    budget.track(model, optimizer)
    with budget:
        for step, batch in enumerate(loader, 1):
            guard.accumulate(batch, loss_fn)
            optimizer.step()
            optimizer.zero_grad()
            if step == ctx.steps:
                break
    guard_outcome(guard, result)
    result.notes.append("guard_for after accelerator.prepare; guard.accumulate per global batch, Accelerate steps")
    return result
