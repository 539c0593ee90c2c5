"""The arguments of :class:`~autoaccum.guard.OOMGuard`, checked before it holds any state (invariant 7:
an error naming the value and the allowed range, raised before any work): the parameters a step
trains, the plan it starts from, and the options, in the order of the constructor's arguments."""

from __future__ import annotations

from typing import Any, get_args

import torch

from autoaccum.batch import SplitFn
from autoaccum.batchnorm import smallest_micro_batch
from autoaccum.cut import Cutter
from autoaccum.growth import GrowMode, check_growth_options, prior_of
from autoaccum.memory_model import MemoryModel
from autoaccum.optim_step import NONFINITE_POLICIES, NonFinite
from autoaccum.sync import OverlapMode
from autoaccum.plan import Plan, resolve_plan
from autoaccum.task import check_optimizer_covers, trainable_parameters
from autoaccum.validate import check_choice, check_positive_float, check_positive_int

__all__ = ["checked_options", "guard_plan", "trained_params"]


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
    """The plan the guard starts from, with the smallest micro-batch the model's BatchNorm allows."""
    resolved = resolve_plan(plan, target_batch=target_batch, micro_batch=micro_batch, world_size=world_size)
    smallest = smallest_micro_batch(model)
    if smallest <= resolved.min_micro_batch:
        return resolved
    try:
        return resolved.with_min_micro_batch(smallest)
    except ValueError:
        raise ValueError(f"Invalid micro_batch: {resolved.micro_batch}. {type(model).__name__} has BatchNorm "
                         f"layers in training mode, which need more than one sample per micro-batch. Allowed "
                         f"range: {smallest} ~ any") from None


def checked_options(model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: Any, *,
                     max_grad_norm: float | None, grow: GrowMode, grow_after: int | None,
                     memory_model: MemoryModel | None, headroom: float | None, thrash_steps: int,
                     nonfinite: NonFinite | None, overlap: OverlapMode, split_fn: SplitFn | None,
                     cut: Cutter | None) -> tuple[MemoryModel | None, float]:
    """Check the guard's options (in the order of the arguments); the memory model and headroom growth uses."""
    if max_grad_norm is not None:
        check_positive_float(max_grad_norm, "max_grad_norm", hint=", or None for no clipping")
    check_growth_options(grow, grow_after, memory_model)
    prior = prior_of(plan, memory_model, headroom)
    check_positive_int(thrash_steps, "thrash_steps")
    check_choice(nonfinite, "nonfinite", (*NONFINITE_POLICIES, None))
    check_choice(overlap, "overlap", get_args(OverlapMode))
    check_optimizer_covers(model, optimizer)
    if split_fn is not None and cut is not None:
        raise TypeError("give split_fn= or cut=, not both (a cutter splits batches itself)")
    return prior
