"""accelerate: ``find_executable_batch_size`` around a training function that builds its model inside (as
Accelerate's example does), ``accelerator.accumulate``, and ``gradient_accumulation_steps = target //
batch_size`` recomputed on every retry (the careful user)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..context import Context, RunResult
from ..recorder import Recorder
from ..workloads import make_optimizer
from .common import Rows, batched, finder_cost, mean_loss


def run(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size

    target = ctx.workload.target_batch
    accelerator = Accelerator(cpu=ctx.device.type == "cpu")
    dataset = Rows(ctx.data)
    holder: dict[str, Any] = {}
    recorder.phase = "train"  # the finder is the training run: every attempt trains from the start

    @find_executable_batch_size(starting_batch_size=target)
    def train(batch_size: int) -> None:
        accelerator.free_memory()
        recorder.new_attempt()
        accelerator.gradient_accumulation_steps = max(1, target // batch_size)
        model = recorder.watch_model(copy.deepcopy(ctx.base))
        optimizer = make_optimizer(model)
        recorder.watch_optimizer(optimizer)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=batched)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        holder.update(micro=batch_size, accum=accelerator.gradient_accumulation_steps)
        loss_fn = mean_loss(recorder)
        steps = 0
        for batch in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
                optimizer.step()
                optimizer.zero_grad()
            del loss
            steps += accelerator.sync_gradients
            if steps == ctx.steps:
                holder["model"] = model  # only the run that finished: a kept failed model would leak
                return

    result = RunResult()
    budget.track()
    try:
        with budget:
            train()
    except Exception as exc:
        result.error = f"crashed: {type(exc).__name__}: {str(exc)[:60]}"
    result.model = accelerator.unwrap_model(holder["model"]) if "model" in holder else None
    result.micro_batch = holder.get("micro")
    finder_cost(result, recorder, budget)
    result.notes.append(f"micro {holder.get('micro')} x accum {holder.get('accum')} (accum = target // micro); "
                        f"finder: starting_batch_size={target}, x0.9 per OOM, restarts training")
    return result
