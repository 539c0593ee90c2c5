"""How HF's ``compute_loss`` becomes the guard's loss function (``TrainerLoss``): normalised as HF's
full-batch step normalises it (token counts over the whole global batch and every rank, or a
model's own token mean reweighted by its token share), with padding-free (packed) batches cut
between whole examples (``KeepExamples``) and the trainer's per-step metric state put back before
each attempt."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from autoaccum.memory.chunked_loss import loss_only
from autoaccum.plan.batch import Batch, Samples, split_batch
from autoaccum.plan.task import LossOutput
from autoaccum.state import capture_buffers, capture_rng, restore_buffers, restore_rng, state_buffers
from autoaccum.step.losses import IGNORE_INDEX

__all__ = ["EXAMPLES", "STEP_METRICS", "KeepExamples", "TrainerLoss", "flattens"]

#: per-step metric state of trainers built on HF's (TRL's), put back before each attempt at a step
STEP_METRICS = ("_metrics", "_total_train_tokens")
#: where a padding-free batch keeps its examples (each micro-batch is collated from them)
EXAMPLES = "autoaccum_examples"


def flattens(collator: Any) -> bool:
    """Whether ``collator`` puts a whole batch in one row (padding-free): TRL's ``padding_free=True``
    (and its "bfd" packing), HF's ``DataCollatorWithFlattening``."""
    from transformers import DataCollatorWithFlattening

    return bool(getattr(collator, "padding_free", False)) or isinstance(collator, DataCollatorWithFlattening)


def _lengths(examples: list[Any]) -> tuple[int, ...]:
    return tuple(len(e["input_ids"]) if isinstance(e, Mapping) and "input_ids" in e else 1 for e in examples)


class KeepExamples:
    """A padding-free collator's batch, and the examples it was made of under ``EXAMPLES``: uncollated
    ``Samples`` whose parts (micro-batches of whole examples) stay uncollated until the loss collates them."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        batch = dict(self.collator(examples))
        batch[EXAMPLES] = Samples(tuple(examples), _lengths(examples), self._part)
        return batch

    def _part(self, examples: list[Any]) -> Samples:
        return Samples(tuple(examples), _lengths(examples), self.collator)


def _collated(batch: Batch) -> Batch:
    """A batch of kept examples, collated (a global batch's: via its parts); any other batch as it is."""
    while isinstance(batch, Samples):
        batch = batch.collate_fn(list(batch.items))
    return batch


class TrainerLoss:
    """HF's ``compute_loss`` on one micro-batch, normalised as HF's full-batch step normalises it
    (see the module docstring); with ``count_items`` the guard counts the step's items up front."""

    def __init__(self, trainer: Any) -> None:  # an AutoAccumTrainer
        from transformers import Trainer

        self.trainer = trainer
        # HF's own compute_loss reads the model's output for its loss alone (labels given): the chunked loss may
        # leave its logits out; a compute_loss of the user's (or TRL's) may read them
        self._stock_loss = type(trainer).compute_loss is Trainer.compute_loss
        self.own_mean_shifts: bool | None = None  # the model's own token mean skips each row's first label
        self._unknown = False  # that could not be told: micro-batches weighted by samples (warned once)

    def _hf_counts(self) -> bool:
        """HF counts items and passes the count (the model takes loss keyword arguments, or a
        ``compute_loss_func``); otherwise the loss is the model's own mean over its micro-batch."""
        t = self.trainer
        return bool(t.model_accepts_loss_kwargs or t.compute_loss_func is not None)

    def _labels(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor | None:
        """The labels the loss averages over, for per-token labels; None for a per-sample mean."""
        if not isinstance(batch, Mapping) or "labels" not in batch:
            return None
        if "shift_labels" in batch:
            return batch["shift_labels"]
        labels = batch["labels"]
        if not isinstance(labels, torch.Tensor) or labels.dim() < 2 or labels.is_floating_point():
            return None  # per-sample labels: weighted means (see the module docstring)
        if self._hf_counts():
            return labels[..., 1:] if getattr(self.trainer, "_loss_shifts_labels", False) else labels
        shifts = self._own_mean_shifts(model, batch, labels)
        if shifts is None:
            return None
        return labels[..., 1:] if shifts else labels

    def _own_mean_shifts(self, model: torch.nn.Module, batch: Mapping[str, Any], labels: torch.Tensor) -> bool | None:
        """Whether the model's own per-token mean skips each row's first label (a causal LM shifting
        labels inside its forward). It matters only for rows whose first label is a target; at the
        first such batch the model is asked once (``_ask_model``)."""
        if self.own_mean_shifts is not None or self._unknown:
            return self.own_mean_shifts
        first_kept = labels[..., 0].ne(IGNORE_INDEX).reshape(labels.shape[0], -1).any(dim=1)
        if not bool(first_kept.any()):
            return False  # no row's first label counts either way
        answer = self._ask_model(model, batch, int(first_kept.nonzero()[0, 0]))
        if answer is None:
            self._unknown = True
            warnings.warn(
                f"AutoAccumTrainer cannot tell which labels the loss of {type(self._module(model)).__name__} "
                f"averages over (its forward takes no loss keyword arguments, so HF passes it no token count, and "
                f"asking it failed). Micro-batches are weighted by samples, which is the full-batch token mean only "
                f"where they hold equal token counts. Give forward **kwargs and divide the summed token losses by "
                f"num_items_in_batch, or pass compute_loss_func=.", UserWarning, stacklevel=2)
        else:
            self.own_mean_shifts = answer
        return answer

    def _module(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.trainer.accelerator.unwrap_model(model)

    def _ask_model(self, model: torch.nn.Module, batch: Mapping[str, Any], row: int) -> bool | None:
        """One forward, without gradients, of row ``row`` with only its first label kept: a loss that
        skips first labels averages over no target (NaN, or 0), one that counts them gives that
        label's loss. Run on the module itself (no collective), with RNG and buffers put back."""
        t = self.trainer
        module = self._module(model)
        rng, buffers = capture_rng(), capture_buffers(state_buffers(module))
        try:
            n = batch["labels"].shape[0]
            one = dict(split_batch(batch, [row, 1, n - row - 1])[1])
            kept = one["labels"].clone()
            kept[..., 1:] = IGNORE_INDEX
            one["labels"] = kept
            with torch.no_grad(), t.compute_loss_context_manager():
                loss = t.compute_loss(module, t._prepare_inputs(one))
        except Exception:  # noqa: BLE001 -- any failure means: the count cannot be read this way
            return None
        finally:
            restore_rng(rng)
            restore_buffers(buffers)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return None
        value = float(loss.detach().float())
        if math.isnan(value) or value == 0.0:
            return True
        return False if math.isfinite(value) and value > 0 else None

    def count_items(self, model: torch.nn.Module, batch: Batch) -> int | None:
        labels = self._labels(model, _collated(batch))
        return None if labels is None else int(labels.ne(IGNORE_INDEX).sum())

    def begin_attempt(self) -> None:
        """The guard starts an attempt at the step: the trainer's per-step metrics as at the step's start."""
        self.trainer._restore_step_metrics()

    def _hf_factor(self) -> int:
        """What HF's ``compute_loss`` multiplies a count-normalised loss by (DDP averages gradients;
        the guard sums them)."""
        t = self.trainer
        if not getattr(t.args, "average_tokens_across_devices", False):
            return 1
        tp = t.get_tp_size() if hasattr(t, "get_tp_size") else 1
        return max(t.accelerator.num_processes // tp, 1)

    def _compute(self, model: torch.nn.Module, batch: Batch, count: torch.Tensor | None) -> torch.Tensor:
        t = self.trainer
        inputs = t._prepare_inputs(batch)
        with t.compute_loss_context_manager(), loss_only() if self._stock_loss else contextlib.nullcontext():
            loss = t.compute_loss(model, inputs, num_items_in_batch=count)
        return loss if count is None else loss / self._hf_factor()

    def __call__(self, model: torch.nn.Module, batch: Batch, num_items_in_batch: int | None = None) -> LossOutput:
        device = self.trainer.args.device
        batch = _collated(batch)  # a micro-batch of whole examples (padding-free): collated as the loader does
        if not self._hf_counts():
            return self._own_mean(model, batch, num_items_in_batch)
        if num_items_in_batch is not None:  # the step's count, all micro-batches and ranks: HF's own path
            return self._compute(model, batch, torch.tensor(num_items_in_batch, device=device))
        counted = self.count_items(model, batch)
        if counted is None:
            return self._compute(model, batch, None)  # a mean loss
        # without the step's count (the probe): the loss sum (HF's loss with a count of 1) and its items
        return self._compute(model, batch, torch.tensor(1, device=device)), counted

    def _own_mean(self, model: torch.nn.Module, batch: Batch, num_items_in_batch: int | None) -> LossOutput:
        """The model's own mean loss (HF passes no count): per-token labels reweighted by the
        micro-batch's share of the step's tokens, ``mean * n / N`` = its summed token losses over N."""
        counted = self.count_items(model, batch)  # first: asking the model (once) runs no forward beside this one
        loss = self._compute(model, batch, None)
        if counted is None:
            return loss  # a per-sample mean, weighted by samples
        if counted == 0:  # no target: its mean is 0/0; it adds nothing to the step
            loss = loss.nan_to_num(0.0) * 0.0
        if num_items_in_batch is None:  # the probe: (sum, count)
            return loss * counted, counted
        return loss * (counted / num_items_in_batch) if num_items_in_batch else loss * 0.0
