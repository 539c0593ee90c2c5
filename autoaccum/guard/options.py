"""The guard's options, checked before it holds any state (invariant 7), and what ``budget=`` means for it."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from autoaccum.guard.growth import check_growth_options, prior_of
from autoaccum.log import user_stacklevel
from autoaccum.memory import TrackedMemory, emulated_device, refuse_two_budgets
from autoaccum.memory.model import MemoryModel
from autoaccum.step.optim import NONFINITE_POLICIES
from autoaccum.units import parse_bytes
from autoaccum.validate import check_choice, check_positive_float, check_positive_int

__all__ = ["check_options", "check_scheduler", "emulated_for_guard"]


def check_options(plan: Any, scheduler: Any, max_grad_norm: Any, grow: Any, grow_after: Any, memory_model: Any,
                  headroom: Any, thrash_steps: Any, nonfinite: Any, split_fn: Any, cut: Any
                  ) -> tuple[MemoryModel | None, float]:
    """The guard's options, in the order of its arguments; returns the memory model and headroom growth uses."""
    check_scheduler(scheduler)
    if max_grad_norm is not None:
        check_positive_float(max_grad_norm, "max_grad_norm", hint=", or None for no clipping")
    check_growth_options(grow, grow_after, memory_model)
    prior = prior_of(plan, memory_model, headroom)
    check_positive_int(thrash_steps, "thrash_steps")
    check_choice(nonfinite, "nonfinite", (*NONFINITE_POLICIES, None))
    if split_fn is not None and cut is not None:
        raise TypeError("give split_fn= or cut=, not both (a cutter splits batches itself)")
    return prior


def check_scheduler(scheduler: Any) -> None:
    """Refuse a ``scheduler=`` the guard could not step: it calls ``scheduler.step()``, with no argument, after
    each ``optimizer.step()``, where a failure would leave a half-done step (the weights moved, the schedule not).

    Raises:
        TypeError: no callable ``step``, or a ``step`` that needs an argument (``ReduceLROnPlateau``'s metric).
    """
    if scheduler is None:
        return
    shown = repr(scheduler) if isinstance(scheduler, (str, bytes, int, float)) else f"a {type(scheduler).__name__}"
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise TypeError(f"scheduler={shown} has no step() method; expected a torch.optim.lr_scheduler.LRScheduler "
                        f"(e.g. CosineAnnealingLR(optimizer, T_max=total_steps)) or an object with step(), which the "
                        f"guard calls once per optimizer step. Build the scheduler on this optimizer first, or pass "
                        f"scheduler=None and step it yourself")
    try:
        inspect.signature(step).bind()
    except TypeError:
        raise TypeError(f"scheduler={shown}: its step{inspect.signature(step)} needs an argument, and the guard calls "
                        f"step() with none, once per optimizer step. A scheduler driven by a metric "
                        f"(ReduceLROnPlateau) is stepped by your loop: pass scheduler=None and call "
                        f"scheduler.step(val_loss) after evaluating") from None
    except ValueError:  # no signature to read (a builtin): taken as it is
        pass
    if isinstance(scheduler, (torch.optim.lr_scheduler.StepLR, torch.optim.lr_scheduler.MultiStepLR)):
        when = f"step_size={scheduler.step_size}" if isinstance(scheduler, torch.optim.lr_scheduler.StepLR) else \
            f"milestones={sorted(scheduler.milestones)}"
        warnings.warn(f"scheduler={type(scheduler).__name__}({when}) is stepped once per optimizer step, not once per "
                      f"epoch: {when} counts optimizer steps. For a per-epoch schedule give it in steps (epochs x "
                      f"steps per epoch), or pass scheduler=None and step it at each epoch's end yourself",
                      UserWarning, stacklevel=user_stacklevel())


def emulated_for_guard(budget: Any, device: torch.device, model: torch.nn.Module, meter: Any,
                       plan: Any) -> TrackedMemory | None:
    """What ``OOMGuard(budget=...)`` means: off CUDA, the emulated device its steps run on (and are read with), as
    in ``fit`` and the integrations (``autoaccum.memory.tracked.emulated_device``); None without a budget.

    On CUDA ``budget=`` is only the memory a probe plans for, and the guard runs none (its plan comes from ``plan=``
    or ``micro_batch=``): there it would mean nothing and is refused, the rule of ``fit`` and the integrations
    for ``budget=`` next to ``plan=``.

    Raises:
        TypeError: ``budget=`` on CUDA, with ``meter=``, or inside an ``emulated_budget(...)`` block.
        ValueError: an unreadable budget, or a compiled model.
    """
    if budget is None:
        return None
    if device.type == "cuda":
        parse_bytes(budget)  # an unreadable budget is named as such first
        refuse_two_budgets(budget)
        given = "plan=" if plan is not None else "target_batch= and micro_batch="
        raise TypeError(f"budget={budget!r} would mean nothing on cuda: off CUDA it is the emulated device the "
                        f"guard's steps run on; on CUDA it is only the memory a probe plans for, and OOMGuard runs "
                        f"no probe (its plan comes from {given}). On CUDA plan for it with "
                        f"autoaccum.probe(..., budget={budget!r}) and pass plan=report, or cap this process with "
                        f"torch.cuda.set_per_process_memory_fraction(...); or drop budget=")
    emulated = emulated_device(budget, device, model)
    if emulated is not None and meter is not None:
        raise TypeError("budget= off CUDA is the emulated device each step runs on and is read with; meter= would "
                        "be another: give one")
    return emulated
