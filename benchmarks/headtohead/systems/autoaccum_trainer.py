"""autoaccum inside the Transformers ``Trainer``: ``AutoAccumTrainer`` with ``per_device_train_batch_size =
target`` and ``gradient_accumulation_steps = 1`` (the global batch the user configures), the same
``compute_loss_func`` and order as the ``transformers`` row; HF steps, autoaccum cuts and replays."""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import torch
from torch import nn

from ..context import Context, RunResult
from ..recorder import Recorder
from ..workloads import LR, Batch, on_device
from .common import GlobalRows, batched, guard_outcome, record_probe
from .transformers_system import token_loss


def run(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    import transformers
    from transformers import TrainingArguments

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
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="compare-autoaccum-trainer-"), per_device_train_batch_size=target,
        gradient_accumulation_steps=1, max_steps=ctx.steps, learning_rate=LR, weight_decay=0.0, max_grad_norm=0.0,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", report_to="none", logging_strategy="no",
        save_strategy="no", disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0,
        use_cpu=ctx.device.type == "cpu", seed=0)
    trainer = BenchTrainer(model=model, args=args, train_dataset=GlobalRows(ctx.data), data_collator=batched,
                           compute_loss_func=token_loss)
    result.model = model
    budget.track(model)
    with budget:  # an OOM the guard cannot replay (in optimizer.step) ends the run: the runner reports it
        trainer.train()
    guard_outcome(trainer.autoaccum_guard, result)
    result.notes.append(f"per_device_train_batch_size {target}, gradient_accumulation_steps 1 (the global batch); "
                        f"HF's loop, clipping off, constant LR; the guard's micro-batches inside training_step")
    return result
