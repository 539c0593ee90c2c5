"""The exact gradient of one global batch (invariant 2), as a component.

``accumulate`` runs the forward and backward of each micro-batch of one rank inside the sync's
accumulation window (no gradient collective of the model's own), each loss weighted so that the
summed gradients are those of the whole global batch:

- a **mean loss** over a micro-batch of ``n_i`` samples is weighted by ``n_i / N``, ``N`` the
  samples of the global batch over all ranks (each ``.backward()`` adds to ``.grad``);
- a **token-level loss** ``(loss_sum, num_items)`` is summed as it is, and ``reduce_gradients``
  divides the summed gradients once by the item count of the whole step, over all micro-batches
  and ranks (not a mean of means);
- a loss **normalised by the step's item count** (Hugging Face's ``num_items_in_batch``, counted
  by the caller up front) is summed as it is: each micro-batch's loss is already its share.

It never raises for what a micro-batch did: it returns ``Accumulated``, or ``Failed`` with the
phase and (for errors other than OOM) the exception. Catching here keeps the exception, and the
activations its traceback holds, inside this frame, which is gone by the time the caller recovers
(``autoaccum.memory.recovery``). With ``backward=False`` it evaluates: the same weighting under
``torch.no_grad()``, no window, no gradients.

``reduce_gradients`` then sums gradients over ranks once, adds up the step's scalars in one
exchange, and normalises token-level gradients: the gradient of the global batch, ready for an
optimizer step (the guard's, or a trainer's own).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

import torch

from autoaccum.distributed.sync import GradSync, LocalSync
from autoaccum.errors import AutoAccumError, TaskError
from autoaccum.memory.recovery import drop_frames, is_oom
from autoaccum.plan.batch import Batch, move_to
from autoaccum.plan.cut import MicroBatch
from autoaccum.plan.task import LossFn, check_loss, explain_error
from autoaccum.precision import autocast

__all__ = ["Accumulated", "Failed", "LossKind", "StepTotals", "accumulate", "check_item_total", "raise_failure",
           "reduce_gradients", "step_scalars", "sum_dtype"]

LossKind = Literal["mean", "sum", "normalized"]


@dataclass(frozen=True)
class Accumulated:
    """Every micro-batch of this rank ran; its gradients hold their weighted sum.

    Attributes:
        loss_sum: the micro-batches' mean losses times their sample counts, or their loss sums
            (token-level), summed on the device in float64 where the device has it (no read of a
            loss on the host, which would wait for the device).
        num_items: this rank's item count for token-level losses (0 for mean and normalised losses).
        kind: ``mean``, ``sum`` or ``normalized``; None when this rank ran no micro-batch (an empty share).
    """

    loss_sum: torch.Tensor
    num_items: torch.Tensor | int
    kind: LossKind | None


@dataclass(frozen=True)
class Failed:
    """A micro-batch failed.

    Attributes:
        oom: it ran out of memory (the exception was dropped with its traceback).
        where: ``forward/loss`` or ``backward``.
        error: the exception, for failures other than OOM (re-raised by the caller after the ranks agree).
    """

    oom: bool
    where: str
    error: BaseException | None = None


@dataclass(frozen=True)
class StepTotals:
    """What one global batch added up to, over all ranks.

    Attributes:
        loss_total: the step's loss times ``divisor`` (a device tensor in one process: reading it
            waits for the device, so ``loss`` is read after the optimizer step is launched).
        divisor: samples (mean losses) or items (token-level losses) of the step.
        num_samples: samples of the step over all ranks.
        num_items: items of the step for token-level losses, else None.
    """

    loss_total: torch.Tensor | float
    divisor: int
    num_samples: int
    num_items: int | None

    @property
    def loss(self) -> float:
        """The step's loss, weighted by samples (or items) exactly as a full-batch step's."""
        return float(self.loss_total) / self.divisor if self.divisor else float("nan")


def sum_dtype(device: torch.device) -> torch.dtype:
    """Losses are summed in float64 where the device has it (MPS has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


def accumulate(model: torch.nn.Module, micro_batches: Iterable[MicroBatch], loss_fn: LossFn, *, num_samples: int,
               device: torch.device, sync: GradSync | None = None, scaler: torch.amp.GradScaler | None = None,
               autocast_dtype: torch.dtype | None = None, backward: bool = True,
               num_items_in_batch: int | None = None, copy_inputs: bool = False) -> Accumulated | Failed:
    """Forward (and backward) of every micro-batch, weighted for the global batch of ``num_samples``.

    Args:
        model: what ``loss_fn(model, micro_batch)`` runs (a DDP wrapper, an FSDP2 module, a module).
        micro_batches: this rank's micro-batches of the step (from a cutter), moved to ``device`` one
            at a time; an empty one (``num_samples == 0``) runs nothing.
        loss_fn: ``loss_fn(model, batch)`` -> mean loss, or ``(loss_sum, num_items)``.
        num_samples: samples of the global batch over all ranks (the weights' denominator).
        sync: the accumulation window (default: one process).
        scaler: a GradScaler (fp16): each weighted loss is scaled before backward.
        autocast_dtype: run forward and loss under ``torch.autocast`` with this dtype.
        backward: False to evaluate (no gradients, no window).
        num_items_in_batch: the step's item count over all micro-batches and ranks, counted up front:
            passed to ``loss_fn(model, batch, num_items_in_batch=...)``, which returns its loss
            already divided by it (Hugging Face's convention).
        copy_inputs: copy each micro-batch's tensors even where they are on ``device`` already, as a
            transfer to a GPU allocates them (under an emulated budget, so that they count).

    Returns:
        ``Accumulated``, or ``Failed`` (never raises for what a micro-batch did).
    """
    sync = sync if sync is not None else LocalSync()
    loss_sum = torch.zeros((), dtype=sum_dtype(device), device=device)
    items: torch.Tensor | int = 0
    kind: LossKind | None = None
    where = "forward/loss"
    window = sync.no_sync() if backward else torch.no_grad()
    cast = autocast(device, autocast_dtype)  # entered once per micro-batch, one after the other (never nested)
    try:
        with window:
            for micro in micro_batches:
                if micro.num_samples == 0:
                    continue  # an empty micro-step: counted by the cutter, no forward
                size = micro.num_samples
                part = move_to(micro.batch, device, copy=copy_inputs)
                micro = None  # type: ignore[assignment]  # the moved copy is the only reference
                where = "forward/loss"
                with cast:
                    if num_items_in_batch is None:
                        output = loss_fn(model, part)
                    else:
                        output = loss_fn(model, part, num_items_in_batch=num_items_in_batch)  # type: ignore[call-arg]
                    loss, num_items = check_loss(output, requires_grad=backward)
                    output = None
                if num_items_in_batch is not None and num_items is not None:
                    raise TaskError("loss_fn was given num_items_in_batch and returned (loss_sum, num_items); with "
                                    "num_items_in_batch it returns the loss divided by it")
                this: LossKind = "mean" if num_items is None else "sum"
                if num_items_in_batch is not None:
                    this = "normalized"
                if kind is not None and this != kind:
                    raise TaskError("loss_fn returned a mean loss for one micro-batch and (loss_sum, num_items) "
                                    "for another; return the same kind for every batch")
                kind = this
                if this == "normalized":
                    weighted = loss  # already this micro-batch's share of the full-batch loss
                elif num_items is None:
                    # each .backward() adds to .grad: weight each mean by its share of the samples
                    weighted = loss * (size / num_samples)
                else:
                    # token-level: sum now, divide the whole step by its item count once (reduce_gradients)
                    weighted = loss
                    items = items + num_items
                loss_sum.add_(loss.detach(), alpha=size if this == "mean" else 1)  # one kernel, in fp64
                if backward:
                    where = "backward"
                    (scaler.scale(weighted) if scaler is not None else weighted).backward()
                del loss, weighted, part
    except Exception as exc:  # noqa: BLE001 - sorted: an OOM is recovered, anything else re-raised by the caller
        if is_oom(exc):
            drop_frames(exc)  # no frame of the failed attempt keeps a tensor, cycle or not
            return Failed(oom=True, where=where)
        return Failed(oom=False, where=where, error=exc)
    return Accumulated(loss_sum, items, kind)


def raise_failure(result: Accumulated | Failed, model: torch.nn.Module, batch: Batch) -> NoReturn:
    """Raise for an attempt that failed with an error: this rank's own exception (explained where a known
    mistake caused it, ``autoaccum.plan.task.explain_error``), or, where another rank's caused it (no
    error here), one that says so."""
    if isinstance(result, Failed) and result.error is not None:
        explained = explain_error(result.error, model, batch)
        if explained is None:
            raise result.error  # the original exception, unchanged
        raise explained from result.error
    raise AutoAccumError("another rank failed with an error during this step; see its log")


def step_scalars(result: Accumulated) -> torch.Tensor:
    """This rank's scalars of the step, summed over ranks in one exchange: loss sum, item count, and
    which kind of loss it saw (a rank with an empty share of the last batch saw none), on the loss
    sum's device (no read of it: the exchange runs where it is)."""
    loss_sum = result.loss_sum
    kinds = [float(result.kind == "mean"), float(result.kind == "sum")]
    if isinstance(result.num_items, int):  # counted on the host: one tensor made, the loss sum put in place
        scalars = loss_sum.new_tensor([0.0, float(result.num_items)] + kinds)
        scalars[0] = loss_sum
        return scalars
    count = torch.as_tensor(result.num_items, dtype=loss_sum.dtype, device=loss_sum.device).reshape(())
    return torch.stack([loss_sum, count, loss_sum.new_tensor(kinds[0]), loss_sum.new_tensor(kinds[1])])


def check_item_total(total: torch.Tensor | float) -> int:
    """The item count of ``(loss_sum, num_items)`` losses added up, as an int.

    Raises:
        TaskError: a fraction or a value below 0: the counts were not counts (a metric, a mean), and
            dividing by them would scale the gradient silently.
    """
    value = float(total)
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise TaskError(f"loss_fn's num_items add up to {value:g}, which is not a count of items (a whole number "
                        f">= 0); num_items is the number of items (e.g. tokens) its loss_sum sums over, and the step "
                        f"divides by their total. Return (loss_sum, count), e.g. (labels != -100).sum(), or the mean "
                        f"loss alone")
    return int(value)


def reduce_gradients(params: Sequence[torch.nn.Parameter], result: Accumulated, *, num_samples: int,
                     sync: GradSync | None = None, num_items_in_batch: int | None = None) -> StepTotals:
    """Sum gradients over ranks once, add up the step's scalars, normalise token-level gradients.

    Afterwards each parameter's ``.grad`` is the gradient of the global batch (for an optimizer
    step, clipping or a trainer's own step).

    Args:
        params: the parameters whose gradients ``accumulate`` summed.
        result: this rank's ``Accumulated``.
        num_samples: samples of the global batch over all ranks.
        sync: how ranks sum gradients and scalars (default: one process).
        num_items_in_batch: the step's item count where the losses were normalised by it up front.

    Returns:
        The step's totals over all ranks (its loss, samples and items).

    Raises:
        TaskError: ranks returned different kinds of loss, or a token-level step counted 0 items.
    """
    sync = sync if sync is not None else LocalSync()
    sync.reduce_gradients(list(params))
    loss_total: torch.Tensor | float
    if num_items_in_batch is not None:  # normalised up front: the summed gradient is the step's already
        if sync.world_size == 1:
            loss_total = result.loss_sum
        else:
            loss_total = float(sync.sum_items(result.loss_sum))
        return StepTotals(loss_total, 1, num_samples, num_items_in_batch)
    if sync.world_size == 1:
        # One process: the kind of loss is known here, and no number on the device is needed
        # before the optimizer step. Reading one would wait for the last backward to finish and
        # stall the launch of the step behind it (a hand-written loop does not wait either).
        loss_total, item_total = result.loss_sum, result.num_items
        means, sums = result.kind == "mean", result.kind == "sum"
    else:
        # One exchange for every scalar of the step
        loss_total, item_total, means, sums = sync.sum_items(step_scalars(result)).tolist()
    if means and sums:
        raise TaskError("loss_fn returned mean losses on some ranks and (loss_sum, num_items) on others")
    if not sums:
        return StepTotals(loss_total, num_samples, num_samples, None)
    num_items = check_item_total(item_total)  # a count on the device is read here (one sync)
    if num_items == 0:
        raise TaskError("the step's loss_fn reported 0 items over all micro-batches; nothing to average")
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        # token-level: the summed gradient divided once by the step's item count
        torch._foreach_div_(grads, float(num_items))
    return StepTotals(loss_total, num_items, num_samples, num_items)
