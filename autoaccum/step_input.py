"""What one guarded step is given, checked before any work: the loss function, this rank's
samples against the plan, and the items (tokens) a token-level loss counts over all ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from autoaccum.batch import Batch, batch_size
from autoaccum.plan import Plan
from autoaccum.sync import GradSync
from autoaccum.task import LossFn, check_loss_fn

__all__ = ["check_step_args", "count_items", "local_size"]


def check_step_args(batch: Batch, loss_fn: LossFn) -> None:
    """``loss_fn`` is a loss function (and the arguments are not swapped)."""
    if callable(batch) and not callable(loss_fn):
        raise TypeError(f"OOMGuard.step(batch, loss_fn) got a {type(batch).__name__} as batch and a "
                        f"{type(loss_fn).__name__} as loss_fn: the arguments look swapped")
    check_loss_fn(loss_fn)


def count_items(loss_fn: LossFn, model: torch.nn.Module, batch: Batch) -> int | None:
    """This rank's items of the step, for a loss that counts them up front (``loss_fn.count_items``,
    e.g. the default loss on per-token labels); None for other losses. The ranks' counts are summed
    in the cut's exchange (``autoaccum.cut_agreement``), which also checks them."""
    counter = getattr(loss_fn, "count_items", None)
    count = counter(model, batch) if callable(counter) else None
    return None if count is None else int(count)


def local_size(batch: Batch, plan: Plan, sync: GradSync, size_fn: Callable[[Batch], int] | None, partial: bool) -> int:
    """This rank's samples of the step (``size_fn`` counts them, else :func:`~autoaccum.batch.batch_size`),
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
                         f"({plan.min_micro_batch}: BatchNorm needs more than one value per channel). Drop "
                         f"the epoch's smaller last batch (DataLoader(drop_last=True), or fit(..., "
                         f"last_batch='drop')) or make it hold at least {plan.min_micro_batch} per rank.")
    return n
