"""Models with BatchNorm: their statistics depend on the micro-batch, not on the global batch."""

from __future__ import annotations

import warnings

import torch

from autoaccum.log import user_stacklevel
from autoaccum.plan.plan import Plan

__all__ = ["batchnorm_layers", "smallest_micro_batch", "warn_batchnorm"]


def batchnorm_layers(model: torch.nn.Module) -> list[str]:
    """Names of the BatchNorm layers of ``model`` (their statistics depend on the micro-batch)."""
    return [name or type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def smallest_micro_batch(model: torch.nn.Module) -> int:
    """The smallest micro-batch ``model`` trains at: 2 with a BatchNorm layer in training mode, else 1.

    In training, BatchNorm normalises each channel by statistics over the batch (and any spatial
    positions); torch refuses a single value per channel ("Expected more than 1 value per channel
    when training"), which one sample gives for ``BatchNorm1d`` on ``(N, C)`` and for a
    ``BatchNorm2d`` whose feature map has shrunk to 1 x 1 (the last stage of a ResNet on small
    images). Two samples always give at least two values."""
    return 2 if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()) \
        else 1


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
