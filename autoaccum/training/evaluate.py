"""Evaluation: the loss over a dataset without gradients, weighted exactly as a training step's.

It reuses the accumulation component (``autoaccum.step.accumulate`` with ``backward=False``): each
micro-batch's mean loss is weighted by its samples, token-level losses are summed and divided once
by their item count, over all batches and ranks. An OOM halves only the evaluation micro-batch
(the training plan is unchanged); every rank agrees on it, so that a shrink on one rank is a
shrink on all. Each attempt runs inside the sync's ``evaluation()`` where it has one (FSDP2: the
parameters unsharded once, so that no forward runs a collective a failed rank would not meet).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from autoaccum.distributed.sync import ERROR, OK, OOM, GradSync
from autoaccum.errors import DoesNotFitError, TaskError
from autoaccum.log import rank_level
from autoaccum.memory import TrackedMemory, active_budget
from autoaccum.memory.recovery import release_memory
from autoaccum.plan.batch import batch_size
from autoaccum.plan.cut import Cutter, SampleCut
from autoaccum.plan.data import GlobalBatches
from autoaccum.plan.plan import Plan
from autoaccum.plan.task import LossFn
from autoaccum.step.accumulate import Accumulated, accumulate, sum_dtype

__all__ = ["EvalResult", "evaluate"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    """What one evaluation did: the loss, the micro-batch in force at the end, and the OOMs it recovered."""

    loss: float
    micro_batch: int
    ooms: int


def evaluate(model: torch.nn.Module, batches: GlobalBatches, loss_fn: LossFn, micro_batch: int, *, sync: GradSync,
             device: torch.device, autocast_dtype: torch.dtype | None = None,
             cut: Cutter | None = None, budget: TrackedMemory | None = None) -> EvalResult:
    """Loss over ``batches`` (epoch 0) without gradients, starting at ``micro_batch`` per forward.

    ``budget`` is the emulated device (fit's ``budget=``): entered around each attempt's forwards only,
    as around a training step. What the device holds is the micro-batches it is sent (copied in, so that
    they count), not the host's drawing of a global batch: an allocation there would be an OOM no
    retry can catch.

    Raises:
        DoesNotFitError: a micro-batch of 1 ran out of memory.
    """
    cut = cut if cut is not None else SampleCut()
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=sum_dtype(device), device=device)
    divisor = torch.zeros((), dtype=sum_dtype(device), device=device)
    ooms = 0
    window = getattr(sync, "evaluation", contextlib.nullcontext)  # a sync of one's own may not have it
    region = budget if budget is not None else contextlib.nullcontext()
    try:
        for rb in batches.epoch(0):
            n = batch_size(rb.batch)
            while True:
                plan = Plan.for_target(batches.target_batch, micro_batch, sync.world_size)
                steps = cut.steps(rb.batch, n, plan)
                gathered = sync.gather((n, steps)) if sync.world_size > 1 else ((n, steps),)
                steps = max(g[1] for g in gathered)
                with region, window():
                    result = accumulate(model, cut(rb.batch, n, plan, steps), loss_fn,
                                        num_samples=sum(g[0] for g in gathered), device=device, sync=sync,
                                        autocast_dtype=autocast_dtype, backward=False,
                                        copy_inputs=budget is not None and budget.budget_bytes is not None)
                agreed = sync.agree(OK if isinstance(result, Accumulated) else ERROR if result.error else OOM)
                if agreed == OK:
                    break
                if agreed == ERROR:
                    if not isinstance(result, Accumulated) and result.error is not None:
                        raise result.error
                    raise TaskError("another rank failed with an error during evaluation; see its log")
                result = None  # type: ignore[assignment]  # outside the except block: the failed pass is gone
                ooms += 1
                release_memory(device)
                if micro_batch == 1:
                    emulated = budget if budget is not None else active_budget()  # the emulated device, if any
                    raise DoesNotFitError(None if emulated is None else emulated.last_oom_needed_bytes,
                                          None if emulated is None else emulated.budget_bytes, at_least=True,
                                          suggestions=(
                                              "evaluate on shorter sequences or a smaller model",
                                              "evaluate under bf16 autocast (precision='bf16')",
                                              "pass eval_data=None and evaluate separately on a larger device"))
                old, micro_batch = micro_batch, micro_batch // 2
                logger.log(rank_level(logging.WARNING, sync.rank), "OOM in evaluation: eval micro-batch %d -> %d "
                           "(training plan unchanged)", old, micro_batch)
            loss_sum += result.loss_sum
            divisor += result.num_items if result.kind == "sum" else n
        if sync.world_size > 1:
            loss_sum, divisor = sync.sum_items(torch.stack([loss_sum, divisor])).unbind()
    finally:
        model.train(was_training)
    return EvalResult(float(loss_sum) / max(float(divisor), 1.0), micro_batch, ooms)
