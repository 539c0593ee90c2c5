"""Models with BatchNorm: their statistics depend on the micro-batch, not on the global batch."""

from __future__ import annotations

import warnings

import torch

from autoaccum.plan import Plan

__all__ = ["batchnorm_layers", "warn_batchnorm"]


def batchnorm_layers(model: torch.nn.Module) -> list[str]:
    """Names of the BatchNorm layers of ``model`` (their statistics depend on the micro-batch)."""
    return [name or type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def warn_batchnorm(model: torch.nn.Module, plan: Plan, *, stacklevel: int = 2) -> bool:
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
        f"or ghost batch norm with a fixed ghost size independent of the micro-batch.", stacklevel=stacklevel)
    return True
