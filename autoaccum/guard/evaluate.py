"""A guarded evaluation of one batch, for a loop of one's own (``OOMGuard.evaluate``).

The loss of a batch without gradients, in eval mode, weighted exactly as a training step's (invariant 2): the
accumulation component with ``backward=False`` (``autoaccum.step.accumulate``), each micro-batch's mean loss
weighted by its samples, ``(loss_sum, num_items)`` losses summed and divided once by their count, over all
micro-batches and ranks. It runs in micro-batches of the guard's plan; an OOM halves only the evaluation
micro-batch (the training plan is unchanged), agreed by every rank, and the batch is evaluated again from
its start, outside the ``except`` block. Each attempt runs inside the sync's ``evaluation()`` where it has
one (FSDP2: the parameters unsharded once, so that no forward runs a collective a failed rank would not meet).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autoaccum.distributed.sync import ERROR, OK, OOM, GradSync
from autoaccum.errors import DoesNotFitError
from autoaccum.log import rank_level
from autoaccum.memory import Meter
from autoaccum.memory.recovery import release_memory
from autoaccum.plan.batch import Batch, batch_size
from autoaccum.plan.cut import Cutter
from autoaccum.plan.plan import Plan
from autoaccum.plan.task import LossFn, check_loss_fn
from autoaccum.step.accumulate import Accumulated, accumulate, check_item_total, raise_failure

__all__ = ["BatchEval", "evaluate_batch"]

#: the guard's messages (rank 0 warns; the others log at debug level)
logger = logging.getLogger("autoaccum.guard")

#: at a micro-batch of 1 that does not fit, what to do
EVAL_SUGGESTIONS = ("evaluate on shorter sequences or a smaller model",
                    "evaluate under bf16 autocast (OOMGuard(autocast_dtype=torch.bfloat16))",
                    "evaluate separately on a larger device")


@dataclass(frozen=True)
class BatchEval:
    """One batch evaluated: its loss over every rank, the evaluation micro-batch at the end, the OOMs recovered."""

    loss: float
    micro_batch: int
    ooms: int


def evaluate_batch(model: torch.nn.Module, batch: Batch, loss_fn: LossFn, micro_batch: int, *, sync: GradSync,
                   device: torch.device, cut: Cutter, size_fn: Callable[[Batch], int] | None = None,
                   autocast_dtype: torch.dtype | None = None, copy_inputs: bool = False, meter: Meter | None = None,
                   log_changes: bool = True) -> BatchEval:
    """The loss of ``batch`` (this rank's share) without gradients, in eval mode, in micro-batches of at most
    ``micro_batch``, halved on OOM; the model's mode is put back.

    Args:
        meter: what says the budget and the bytes needed, for ``DoesNotFitError``.
        copy_inputs: copy each micro-batch in, as to a GPU (under an emulated budget, so that they count).

    Returns:
        The loss: the samples' mean loss over every rank (or the items' mean, for ``(loss_sum, num_items)``).

    Raises:
        DoesNotFitError: a micro-batch of 1 ran out of memory.
        TaskError: the counts of ``(loss_sum, num_items)`` losses are not counts.
        TypeError: ``batch`` and ``loss_fn`` swapped, or a ``loss_fn`` that cannot be called so.
    """
    if callable(batch) and not callable(loss_fn):
        raise TypeError(f"OOMGuard.evaluate(batch, loss_fn) got a {type(batch).__name__} as batch and a "
                        f"{type(loss_fn).__name__} as loss_fn: the arguments look swapped")
    check_loss_fn(loss_fn)
    n = size_fn(batch) if size_fn is not None else batch_size(batch)
    was_training, ooms = model.training, 0
    window = getattr(sync, "evaluation", contextlib.nullcontext)  # a sync of one's own may not have it
    model.eval()
    try:
        while True:
            plan = Plan.for_target(max(n, 1), micro_batch)  # the cut reads its micro-batch; ranks agree the steps
            steps = cut.steps(batch, n, plan)
            gathered = sync.gather((n, steps)) if sync.world_size > 1 else ((n, steps),)
            # the largest micro-batch any rank runs: what every rank halves, and decides on, alike
            largest = Plan.for_target(max(max(g[0] for g in gathered), 1), micro_batch).micro_batch
            with window():
                result = accumulate(model, cut(batch, n, plan, max(g[1] for g in gathered)), loss_fn,
                                    num_samples=max(sum(g[0] for g in gathered), 1), device=device, sync=sync,
                                    autocast_dtype=autocast_dtype, backward=False, copy_inputs=copy_inputs)
            status = sync.agree(OK if isinstance(result, Accumulated) else ERROR if result.error else OOM)
            if status == OK:
                break
            if status == ERROR:
                raise_failure(result, model, batch)
            result = None  # type: ignore[assignment]  # outside the except block: the failed pass is gone
            ooms += 1
            release_memory(device)
            if largest == 1:
                raise DoesNotFitError(None if meter is None else meter.last_oom_needed_bytes,
                                      None if meter is None else meter.budget_bytes, EVAL_SUGGESTIONS, at_least=True)
            old, micro_batch = largest, largest // 2
            logger.log(rank_level(logging.WARNING, sync.rank) if log_changes else logging.DEBUG,
                       "OOM in evaluation: eval micro-batch %d -> %d (the training plan is unchanged)", old,
                       micro_batch)
        assert isinstance(result, Accumulated)
        divisor = result.num_items if result.kind == "sum" else n
        totals = torch.stack([result.loss_sum, torch.as_tensor(divisor, dtype=result.loss_sum.dtype,
                                                               device=result.loss_sum.device).reshape(())])
        if sync.world_size > 1:
            totals = sync.sum_items(totals)
    finally:
        model.train(was_training)
    loss_total, count = totals.tolist()
    count = check_item_total(count)
    return BatchEval(loss_total / count if count else float("nan"), largest, ooms)
