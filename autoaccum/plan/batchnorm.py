"""Models with BatchNorm: their statistics depend on the micro-batch, not on the global batch."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from autoaccum.log import user_stacklevel
from autoaccum.plan.batch import Batch, SplitFn, move_to, split_batch
from autoaccum.plan.plan import Plan
from autoaccum.state import capture_buffers, capture_rng, restore_buffers, restore_rng, state_buffers

__all__ = ["batchnorm_floor", "batchnorm_layers", "smallest_micro_batch", "trains_on_one_sample", "warn_batchnorm"]


def batchnorm_layers(model: torch.nn.Module) -> list[str]:
    """Names of the BatchNorm layers of ``model`` (their statistics depend on the micro-batch)."""
    return [name or type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


class _OneValue(Exception):
    """A BatchNorm layer in training mode was given a single value per channel (raised by the trial's hook)."""


def _training_batchnorms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]


def trains_batchnorm(model: torch.nn.Module) -> bool:
    """``model`` has a BatchNorm layer in training mode: its statistics depend on the micro-batch."""
    return bool(_training_batchnorms(model))


def trains_on_one_sample(model: torch.nn.Module, run_one: Callable[[], Any]) -> bool | None:
    """Whether ``model`` trains on one sample, as far as its BatchNorm layers are concerned, found by trying.

    ``run_one()`` runs the model's forward on one sample (the loss on a batch of one). It runs without
    gradients, with a hook on each BatchNorm layer in training mode that stops it where a layer would
    get a single value per channel; the RNG and every buffer (the running statistics) are put back
    afterwards, so nothing of the trial stays. True where every layer got more than one value per
    channel (``BatchNorm1d`` on ``(N, C, L)`` tokens, a ``BatchNorm2d`` on a feature map larger than 1 x 1),
    False where one got a single value, None where the forward failed otherwise (the step that runs it
    for real reports that error)."""
    layers = _training_batchnorms(model)
    if not layers:
        return True

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        # BatchNorm normalises each channel (dim 1) over the batch and every other position
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.numel() // max(x.shape[1], 1) <= 1:
            raise _OneValue(type(module).__name__)

    handles = [m.register_forward_pre_hook(hook) for m in layers]
    rng, buffers = capture_rng(), capture_buffers(state_buffers(model))
    try:
        with torch.no_grad():
            run_one()
    except _OneValue:
        return False
    except Exception:  # noqa: BLE001 -- any other failure: not this trial's to report
        return None
    finally:
        for handle in handles:
            handle.remove()
        restore_rng(rng)
        restore_buffers(buffers)
    return True


def smallest_micro_batch(model: torch.nn.Module, run_one: Callable[[], Any] | None = None) -> int:
    """The smallest micro-batch ``model`` trains at: 1, or 2 where a BatchNorm layer in training mode
    gets a single value per channel from one sample.

    In training, BatchNorm normalises each channel by statistics over the batch and every other
    position; torch refuses a single value per channel ("Expected more than 1 value per channel when
    training"), which one sample gives for ``BatchNorm1d`` on ``(N, C)`` and for a ``BatchNorm2d`` whose
    feature map has shrunk to 1 x 1 (the last stage of a ResNet on small images), but not for
    ``BatchNorm1d`` over tokens (``(N, C, L)``) or a larger feature map. So it is decided by trying one
    sample (``trains_on_one_sample`` with ``run_one``); without ``run_one``, or where the trial fails
    otherwise, 2 for any BatchNorm layer in training mode. Two samples always give at least two values."""
    if not _training_batchnorms(model):
        return 1
    return 1 if run_one is not None and trains_on_one_sample(model, run_one) else 2


def warn_batchnorm(model: torch.nn.Module, plan: Plan) -> bool:
    """Warn that ``plan`` splits the global batch of a model with BatchNorm; True if it warned.

    One micro-batch per rank (no accumulation, one rank) needs no warning: the statistics are the
    global batch's."""
    if plan.accum_steps == 1 and plan.world_size == 1:
        return False
    layers = batchnorm_layers(model)
    if not layers:
        return False
    shown = ", ".join(layers[:5]) + (f" and {len(layers) - 5} more" if len(layers) > 5 else "")
    warnings.warn(
        f"BatchNorm layers ({shown}) normalise each micro-batch of {plan.micro_batch} with its own "
        f"statistics, not those of the global batch of {plan.target_batch}: gradients and running "
        f"stats differ from a full-batch step. Remedies: SyncBatchNorm across ranks, GroupNorm/LayerNorm, "
        f"or ghost batch norm with a fixed ghost size independent of the micro-batch.", stacklevel=user_stacklevel())
    return True


def batchnorm_floor(model: torch.nn.Module, plan: Plan, batch: Batch, size: int, loss_fn: Callable[..., Any],
                    split_fn: SplitFn | None, device: torch.device) -> Plan | None:
    """Before a guard's first step: ``plan`` with the smallest micro-batch ``model`` trains at, found by
    trying one sample of ``batch`` (``smallest_micro_batch``): a model whose BatchNorm gets one value per
    channel from one sample trains at no fewer than 2. None where ``batch`` (of ``size`` samples) is empty
    (a rank's share of a short last batch): the next step tries. ``model`` is the module itself, not a DDP
    wrapper: a trial runs no collective.

    Raises:
        ValueError: the plan's micro-batch is below that smallest one, naming both and the allowed range.
    """
    if plan.min_micro_batch >= 2 or smallest_micro_batch(model) == 1:
        return plan
    if size == 0:
        return None
    try:
        one = batch if size == 1 else split_batch(batch, [1, size - 1], split_fn)[0]
    except (TypeError, ValueError):  # a batch type only the guard's own cut can split: no trial
        smallest = 2
    else:
        smallest = smallest_micro_batch(model, lambda: loss_fn(model, move_to(one, device)))
    if smallest <= plan.min_micro_batch:
        return plan
    try:
        return plan.with_min_micro_batch(smallest)
    except ValueError:
        raise ValueError(f"Invalid micro_batch: {plan.micro_batch}. A BatchNorm layer of {type(model).__name__} "
                         f"gets one value per channel from one sample (torch: 'Expected more than 1 value per channel "
                         f"when training'), so the model trains at no fewer than {smallest} samples per micro-batch. "
                         f"Allowed range: {smallest} ~ any") from None
