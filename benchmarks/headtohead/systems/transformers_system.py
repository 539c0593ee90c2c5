"""transformers: ``Trainer`` with ``auto_find_batch_size=True``, ``per_device_train_batch_size = target``,
``gradient_accumulation_steps = 1``, and the token-count path (``compute_loss_func`` with
``num_items_in_batch``)."""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..context import Context, RunResult
from ..recorder import Recorder
from ..workloads import LR, Batch
from .common import Rows, batched, finder_cost


def token_loss(outputs: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    total = F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else labels.ne(-100).sum())


def training_args(ctx: Context, prefix: str, **kwargs: Any) -> Any:
    """The ``TrainingArguments`` of both Trainer rows: the global batch of ``per_device_train_batch_size = target``
    and ``gradient_accumulation_steps = 1``, AdamW at the shared LR, clipping off, a constant LR, no logging."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix=prefix), per_device_train_batch_size=ctx.workload.target_batch,
        gradient_accumulation_steps=1, max_steps=ctx.steps, learning_rate=LR, weight_decay=0.0, max_grad_norm=0.0,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", report_to="none", logging_strategy="no",
        save_strategy="no", disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0,
        use_cpu=ctx.device.type == "cpu", seed=0, **kwargs)


def run(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    import transformers
    from transformers import Trainer

    transformers.logging.set_verbosity_error()
    target = ctx.workload.target_batch

    class BenchTrainer(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
            return torch.utils.data.SequentialSampler(self.train_dataset)  # the reference's order

        def _inner_training_loop(self, batch_size: int | None = None, *args: Any, **kwargs: Any) -> Any:
            recorder.new_attempt()
            holder["micro"] = batch_size
            return super()._inner_training_loop(batch_size, *args, **kwargs)

        def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
            optimizer = super().create_optimizer(*args, **kwargs)
            recorder.watch_optimizer(self.optimizer)
            return optimizer

        def compute_loss(self, model: nn.Module, inputs: Batch, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            recorder.forward(inputs)  # Trainer's own compute_loss, minus the sample ids the model does not take
            outputs = model(inputs["x"])
            loss = self.compute_loss_func(outputs, inputs["labels"], num_items_in_batch=num_items_in_batch)
            return (loss, outputs) if return_outputs else loss

    holder: dict[str, Any] = {}
    model = recorder.watch_model(copy.deepcopy(ctx.base))
    args = training_args(ctx, "compare-transformers-", auto_find_batch_size=True)
    result = RunResult(model=model)
    recorder.phase = "train"
    budget.track(model)
    try:
        with budget:
            BenchTrainer(model=model, args=args, train_dataset=Rows(ctx.data), data_collator=batched,
                         compute_loss_func=token_loss).train()
    except Exception as exc:
        result.error = f"crashed: {type(exc).__name__}: {str(exc)[:60]}"
    result.micro_batch = holder.get("micro")
    finder_cost(result, recorder, budget)
    result.notes.append(f"per_device_train_batch_size {target} -> {holder.get('micro')}, gradient_accumulation_steps "
                        f"1 (fixed); finder x0.9 per OOM, restarts the inner loop keeping weights and optimizer")
    return result
