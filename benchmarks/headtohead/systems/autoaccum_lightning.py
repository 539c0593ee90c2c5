"""autoaccum inside Lightning: the ``AutoAccum`` callback on an unchanged LightningModule, a DataLoader of
global batches (``batch_size = target``, ``accumulate_grad_batches = 1``). The token-level workload passes
``AutoAccum(loss_fn=(sum, count))``, the documented way to make a token mean exact across micro-batches."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..context import Context, RunResult
from ..recorder import Recorder
from ..workloads import Batch, make_optimizer, on_device
from .common import GlobalRows, batched, guard_outcome, mean_loss, pair_loss, record_probe
from .lightning_system import trainer as lightning_trainer


def run(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    import lightning.pytorch as pl

    from autoaccum.integrations.lightning import AutoAccum

    target = ctx.workload.target_batch
    loss_fn = mean_loss(recorder)
    result = RunResult()

    class Module(pl.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
            return loss_fn(self.model, on_device(batch, ctx.device))  # the micro-batch's copy (see GlobalRows)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            optimizer = make_optimizer(self.model)
            recorder.watch_optimizer(optimizer)
            return optimizer

    pairs = pair_loss(recorder, ctx.device)
    callback = AutoAccum(loss_fn=(lambda module, batch: pairs(module.model, batch)) if ctx.workload.token_level
                         else None)

    class RecordProbe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            record_probe(callback.guard, recorder, result)  # after AutoAccum's on_train_start built it

    module = Module(recorder.watch_model(copy.deepcopy(ctx.base)))
    loader = torch.utils.data.DataLoader(GlobalRows(ctx.data), batch_size=target, shuffle=False, collate_fn=batched)
    trainer = lightning_trainer(ctx, "compare-autoaccum-lightning-", max_steps=ctx.steps,
                                callbacks=[callback, RecordProbe()])
    result.model = module.model
    budget.track(module)
    with budget:
        trainer.fit(module, loader)
    guard_outcome(callback.guard, result)
    result.notes.append("AutoAccum callback; DataLoader of global batches, accumulate_grad_batches 1"
                        + ("; loss_fn=(sum, count)" if ctx.workload.token_level else "; the module's mean loss"))
    return result
