"""The optimizer step after accumulation: unscale once, clip once, step, then the scheduler.

An out-of-memory error here is not replayed (a decided limit, see the README): this memory does
not depend on the micro-batch, so shrinking cannot help, and an OOM inside ``optimizer.step()``
can leave some parameters updated and others not. It raises :class:`OptimizerStepOOMError`
naming the phase, after releasing what the failed phase held and resetting the GradScaler's
record of the step, so that a caller who goes on (e.g. after freeing memory) can step again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoaccum.errors import OptimizerStepOOMError
from autoaccum.recovery import catch_oom, release_memory

__all__ = ["OptimizerStep", "step_oom_error", "step_optimizer"]


@dataclass(frozen=True)
class OptimizerStep:
    """What the optimizer step did.

    Attributes:
        grad_norm: the total gradient norm before clipping (a device tensor, read after the step's
            launch), None without clipping.
        skipped: the GradScaler found inf/NaN gradients and skipped the step (the scheduler did not step).
    """

    grad_norm: torch.Tensor | None
    skipped: bool


def step_oom_error(phase: str, step_number: int, micro_batch: int) -> OptimizerStepOOMError:
    """The error for an OOM after the micro-batches, in ``phase``."""
    partly = " Some parameters may already be updated and others not." if phase == "optimizer.step()" else ""
    return OptimizerStepOOMError(
        f"out of memory in {phase} at optimizer step {step_number}.{partly} This memory does not depend "
        f"on the micro-batch (micro {micro_batch}), so the step is not replayed. What to do: resume from "
        f"the last checkpoint with more headroom; use a leaner optimizer (foreach=False lowers the step's "
        f"peak; fused=True on CUDA); or shard optimizer state (FSDP).")


def step_optimizer(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], *,
                   scaler: torch.amp.GradScaler | None = None, scheduler: Any = None,
                   max_grad_norm: float | None = None, step_number: int = 0,
                   micro_batch: int = 0) -> OptimizerStep:
    """Unscale (once), clip (once), step and update the scaler; step the scheduler unless skipped.

    Raises:
        OptimizerStepOOMError: out of memory in unscaling, clipping or ``optimizer.step()``.
    """
    phase = ["GradScaler.unscale_"]

    def run() -> OptimizerStep:
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm = None
        if max_grad_norm is not None:
            phase[0] = "gradient clipping"
            norm = torch.nn.utils.clip_grad_norm_(list(params), max_grad_norm)  # read after the step
        phase[0] = "optimizer.step()"
        if scaler is None:
            optimizer.step()
            return OptimizerStep(norm, False)
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return OptimizerStep(norm, scaler.get_scale() < scale_before)  # the scale backs off only on inf/NaN

    done, failed = catch_oom(run)
    if failed:  # outside the except block: the traceback is gone
        optimizer.zero_grad(set_to_none=True)
        for p in params:
            p.grad = None
        if scaler is not None:
            # Forget this step's unscale_ record (or the next unscale_ raises "already called"),
            # keeping the scale and its growth tracker as they were: update() with the current scale.
            # A scaler that never scaled a loss (no micro-batch ran here) has no record to forget.
            with contextlib.suppress(AssertionError):
                scaler.update(scaler.get_scale())
        release_memory(params[0].device)
        raise step_oom_error(phase[0], step_number, micro_batch)
    assert done is not None
    if not done.skipped and scheduler is not None:
        scheduler.step()
    return done
