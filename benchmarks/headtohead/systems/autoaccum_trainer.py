"""autoaccum inside the Transformers ``Trainer``: ``AutoAccumTrainer`` with ``per_device_train_batch_size =
target`` and ``gradient_accumulation_steps = 1`` (the global batch the user configures), the same
``compute_loss_func`` and order as the ``transformers`` row; HF steps, autoaccum cuts and replays."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..context import Context, RunResult
from ..recorder import Recorder
from ..workloads import Batch, on_device
from .common import GlobalRows, batched, guard_outcome, record_probe
from .transformers_system import token_loss, training_args


def run(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    import transformers

    from autoaccum.integrations.transformers import AutoAccumTrainer

    transformers.logging.set_verbosity_error()
    target = ctx.workload.target_batch
    result = RunResult()

    class BenchTrainer(AutoAccumTrainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
            return torch.utils.data.SequentialSampler(self.train_dataset)  # the reference's order

        def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
            optimizer = super().create_optimizer(*args, **kwargs)
            recorder.watch_optimizer(self.optimizer)
            return optimizer

        def training_step(self, model: nn.Module, inputs: Batch, num_items_in_batch: Any = None) -> torch.Tensor:
            lazy = self._guard(model)
            if not hasattr(lazy, "_recorded"):
                lazy._recorded = True
                record_probe(lazy, recorder, result)
            return super().training_step(model, inputs, num_items_in_batch)

        def compute_loss(self, model: nn.Module, inputs: Batch, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            recorder.forward(inputs)  # as the transformers row: the model takes x, not the sample ids
            inputs = on_device(inputs, ctx.device)  # the micro-batch's copy on the device (see GlobalRows)
            outputs = model(inputs["x"])
            loss = self.compute_loss_func(outputs, inputs["labels"], num_items_in_batch=num_items_in_batch)
            return (loss, outputs) if return_outputs else loss

    model = recorder.watch_model(copy.deepcopy(ctx.base))
    trainer = BenchTrainer(model=model, args=training_args(ctx, "compare-autoaccum-trainer-"), data_collator=batched,
                           train_dataset=GlobalRows(ctx.data), compute_loss_func=token_loss)
    result.model = model
    budget.track(model)
    with budget:  # an OOM the guard cannot replay (in optimizer.step) ends the run: the runner reports it
        trainer.train()
    guard_outcome(trainer.autoaccum_guard, result)
    result.notes.append(f"per_device_train_batch_size {target}, gradient_accumulation_steps 1 (the global batch); "
                        f"HF's loop, clipping off, constant LR; the guard's micro-batches inside training_step")
    return result
