"""lightning: ``Tuner.scale_batch_size(mode="binsearch")`` on a tuning Trainer, then a Trainer with
``accumulate_grad_batches = target // found`` (the tuner runs inside a Trainer, so the accumulation must
be chosen in a second one)."""

from __future__ import annotations

import copy
import logging
import tempfile
import time
from typing import Any

import torch
from torch import nn

from ..context import Context, RunResult
from ..recorder import Recorder
from ..workloads import Batch, make_optimizer
from .common import Rows, batched, mean_loss


def trainer(ctx: Context, prefix: str, **kwargs: Any) -> Any:
    """A quiet ``pl.Trainer`` on the run's device: no logger, checkpoints, progress bar or summary."""
    import lightning.pytorch as pl

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return pl.Trainer(accelerator="gpu" if ctx.device.type == "cuda" else "cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tempfile.mkdtemp(prefix=prefix), **kwargs)


def run(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner
    target = ctx.workload.target_batch
    dataset = Rows(ctx.data)
    loss_fn = mean_loss(recorder)

    class Module(pl.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model
            self.batch_size = 2

        def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
            return loss_fn(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            optimizer = make_optimizer(self.model)
            recorder.watch_optimizer(optimizer)
            return optimizer

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size, shuffle=False,
                                               collate_fn=batched)

    module = Module(recorder.watch_model(copy.deepcopy(ctx.base)))
    result = RunResult()
    budget.track(module)
    started = time.perf_counter()
    with budget:
        tuner = Tuner(trainer(ctx, "compare-lightning-", max_steps=ctx.steps))
        found = tuner.scale_batch_size(module, mode="binsearch", max_val=target)
        result.find_time_s = time.perf_counter() - started
        result.find_ooms = budget.ooms
        result.find_steps = len([s for s in recorder.steps if s.phase == "find"]) + budget.ooms
        micro = int(found or module.batch_size)
        accum = max(1, target // micro)
        module.batch_size = micro
        recorder.phase = "train"
        recorder.new_attempt()
        recorder.watch_model(module.model)  # restored from the tuner's checkpoint: training starts here
        try:
            trainer(ctx, "compare-lightning-", max_steps=ctx.steps, accumulate_grad_batches=accum).fit(module)
        except Exception as exc:
            result.error = f"crashed: {type(exc).__name__}: {str(exc)[:60]}"
    result.micro_batch, result.planned_micro, result.model = micro, found, module.model
    result.notes.append(f"micro {micro} x accum {accum} (binsearch, 5% margin; accum = target // micro in a "
                        f"second Trainer)")
    return result
