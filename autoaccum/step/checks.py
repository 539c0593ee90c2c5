"""The arguments of ``OOMGuard``, checked before it holds any state (invariant 7:
an error naming the value and the allowed range, raised before any work): the parameters a step
trains, the plan it starts from, and the options, in the order of the constructor's arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autoaccum.memory.model import MemoryModel
from autoaccum.memory.savers import ladder
from autoaccum.plan.batch import Batch, SplitFn, batch_size, move_to, split_batch
from autoaccum.plan.batchnorm import smallest_micro_batch
from autoaccum.plan.cut import Cutter
from autoaccum.plan.plan import Plan
from autoaccum.plan.sources import resolve_plan
from autoaccum.plan.task import LossFn, check_loss_fn, check_optimizer_covers, trainable_parameters
from autoaccum.probe.report import check_made_for
from autoaccum.step.growth import GrowMode, check_growth_options, prior_of
from autoaccum.step.optim import NONFINITE_POLICIES, NonFinite
from autoaccum.step.sync import GradSync
from autoaccum.validate import check_choice, check_positive_float, check_positive_int

__all__ = ["GuardOptions", "batchnorm_floor", "check_step_args", "guard_ladder", "checked_options", "count_items", "guard_plan", "local_size",
           "trained_params"]


def trained_params(model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The parameters whose gradient a step computes, and those of them the optimizer does not step.

    The step's gradient is that of every trainable parameter of the model and of every parameter the
    optimizer steps (e.g. a temperature owned by the loss): token-level normalisation, clipping and
    clearing cover them all. Model parameters outside the optimizer are cleared too, or their
    gradients would carry into the next step (and into its clipping norm)."""
    model_params = trainable_parameters(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    seen = {id(p) for p in model_params}
    params = model_params + [p for group in optimizer.param_groups for p in group["params"]
                             if p.requires_grad and id(p) not in seen]
    return params, [p for p in model_params if id(p) not in in_optimizer]


def guard_plan(model: torch.nn.Module, plan: Any, *, target_batch: int | None, micro_batch: int | None,
                world_size: int) -> Plan:
    """The plan the guard starts from (a probe report only for the model it was measured on). The smallest
    micro-batch a model with BatchNorm trains at is found at the first step (``batchnorm_floor``)."""
    if plan is not None:
        check_made_for(plan, model)
    return resolve_plan(plan, target_batch=target_batch, micro_batch=micro_batch, world_size=world_size)


def batchnorm_floor(model: torch.nn.Module, plan: Plan, batch: Batch, loss_fn: LossFn,
                    size_fn: Callable[[Batch], int] | None, cut: Cutter, device: torch.device) -> Plan | None:
    """At the guard's first step, before any work: ``plan`` with the smallest micro-batch ``model`` trains at,
    found by trying one sample of ``batch`` (``autoaccum.plan.batchnorm.smallest_micro_batch``): a model whose
    BatchNorm gets one value per channel from one sample trains at no fewer than 2. None where ``batch`` is
    empty (a rank's share of a short last batch): the next step tries.

    Raises:
        ValueError: the plan's micro-batch is below that smallest one, naming both and the allowed range.
    """
    if plan.min_micro_batch >= 2 or smallest_micro_batch(model) == 1:
        return plan
    n = size_fn(batch) if size_fn is not None else batch_size(batch)
    if n == 0:
        return None
    split_fn: SplitFn | None = getattr(cut, "split_fn", None)
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    try:
        one = batch if n == 1 else split_batch(batch, [1, n - 1], split_fn)[0]
    except (TypeError, ValueError):  # a batch type only the guard's own cut can split: no trial
        smallest = 2
    else:  # the module itself, not its DDP wrapper: a trial runs no collective
        smallest = smallest_micro_batch(inner, lambda: loss_fn(inner, move_to(one, device)))
    if smallest <= plan.min_micro_batch:
        return plan
    try:
        return plan.with_min_micro_batch(smallest)
    except ValueError:
        raise ValueError(f"Invalid micro_batch: {plan.micro_batch}. A BatchNorm layer of {type(inner).__name__} "
                         f"gets one value per channel from one sample (torch: 'Expected more than 1 value per channel "
                         f"when training'), so the model trains at no fewer than {smallest} samples per micro-batch. "
                         f"Allowed range: {smallest} ~ any") from None


def checked_options(model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: Any, *,
                     max_grad_norm: float | None, grow: GrowMode, grow_after: int | None,
                     memory_model: MemoryModel | None, headroom: float | None, thrash_steps: int,
                     nonfinite: NonFinite | None, split_fn: SplitFn | None,
                     cut: Cutter | None) -> tuple[MemoryModel | None, float]:
    """Check the guard's options (in the order of the arguments); the memory model and headroom growth uses."""
    if max_grad_norm is not None:
        check_positive_float(max_grad_norm, "max_grad_norm", hint=", or None for no clipping")
    check_growth_options(grow, grow_after, memory_model)
    prior = prior_of(plan, memory_model, headroom)
    check_positive_int(thrash_steps, "thrash_steps")
    check_choice(nonfinite, "nonfinite", (*NONFINITE_POLICIES, None))
    check_optimizer_covers(model, optimizer)
    if split_fn is not None and cut is not None:
        raise TypeError("give split_fn= or cut=, not both (a cutter splits batches itself)")
    return prior




def check_step_args(batch: Batch, loss_fn: LossFn) -> None:
    """``loss_fn`` is a loss function (and the arguments are not swapped)."""
    if callable(batch) and not callable(loss_fn):
        raise TypeError(f"OOMGuard.step(batch, loss_fn) got a {type(batch).__name__} as batch and a "
                        f"{type(loss_fn).__name__} as loss_fn: the arguments look swapped")
    check_loss_fn(loss_fn)


def count_items(loss_fn: LossFn, model: torch.nn.Module, batch: Batch) -> int | None:
    """This rank's items of the step, for a loss that counts them up front (``loss_fn.count_items``,
    e.g. the default loss on per-token labels); None for other losses. The ranks' counts are summed
    in the cut's exchange (``autoaccum.step.sync``), which also checks them."""
    counter = getattr(loss_fn, "count_items", None)
    count = counter(model, batch) if callable(counter) else None
    return None if count is None else int(count)


def local_size(batch: Batch, plan: Plan, sync: GradSync, size_fn: Callable[[Batch], int] | None, partial: bool) -> int:
    """This rank's samples of the step (``size_fn`` counts them, else ``batch_size``),
    checked against the plan."""
    n = size_fn(batch) if size_fn is not None else batch_size(batch)
    expected = plan.rank_batch(sync.rank)
    # partial: the epoch's last batch; under torch.distributed a rank's share of it may be empty
    if n != expected and not (partial and 0 <= n < expected and (n > 0 or sync.world_size > 1)):
        hint = " (pass partial=True for the smaller last batch of an epoch)" if 0 < n < expected else ""
        raise ValueError(f"batch holds {n} samples; this rank's share of target_batch {plan.target_batch} "
                         f"is {expected}{hint}. The global batch is never changed silently.")
    if 0 < n < plan.min_micro_batch:
        raise ValueError(f"batch holds {n} sample(s), fewer than the smallest micro-batch this model trains at "
                         f"({plan.min_micro_batch}: its BatchNorm gets one value per channel from one sample). Drop "
                         f"the epoch's smaller last batch (DataLoader(drop_last=True), or fit(..., "
                         f"last_batch='drop')) or make it hold at least {plan.min_micro_batch} per rank.")
    return n


@dataclass(frozen=True)
class GuardOptions:
    """The guard's settings that do not change while it runs (see ``OOMGuard``)."""

    scheduler: Any
    scaler: torch.amp.GradScaler | None
    max_grad_norm: float | None
    autocast_dtype: torch.dtype | None
    size_fn: Callable[[Batch], int] | None
    nonfinite: NonFinite | None
    log_changes: bool
    emulated: bool  # a counter with a budget: micro-batches are copied in, as a GPU's would be


def guard_ladder(model: torch.nn.Module, device: torch.device, plan: Plan, memory_savers: Any) -> tuple[str, ...]:
    """The rungs of the memory ladder the guard may climb; the plan's own rung must be one of them."""
    rungs = ladder(model, device, memory_savers)
    if plan.saver not in rungs:
        raise ValueError(f"the plan runs with memory saver {plan.saver!r}, which is not on this guard's ladder {rungs} "
                         f"(memory_savers={memory_savers!r}, device {device.type}); allow it, or plan again here")
    return rungs
