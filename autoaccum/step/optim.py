"""The optimizer step after accumulation: unscale once, check, clip once, step, then the scheduler.

The check (``check_finite``): inf/NaN gradients never reach the weights. Before the step, one
fused reduction over every gradient (``torch._foreach_norm``; with clipping, the total norm clipping
computes anyway) and one read of its result on the host: a non-finite value skips
``optimizer.step()`` and the scheduler, and the caller decides what follows (stop or skip,
``autoaccum.guard.guard``). The gradients are checked after they were reduced over ranks: under
DDP every rank holds the same sums, so every rank decides the same; under FSDP2 each rank holds a
shard, so the ranks exchange their verdicts (one all-reduce of one number). In fp16 the
GradScaler checks (and skips) itself.

An out-of-memory error here is not replayed, by design: this memory does not depend on the
micro-batch, so shrinking cannot help, and an OOM inside ``optimizer.step()`` can leave some
parameters updated and others not. It raises ``OptimizerStepOOMError`` naming the phase, after
releasing what the failed phase held and resetting the GradScaler's record of the step, so that a
caller who goes on (e.g. after freeing memory) can step again.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import torch

from autoaccum.distributed.sync import GradSync
from autoaccum.errors import OptimizerStepOOMError
from autoaccum.memory.recovery import catch_oom, release_memory

__all__ = ["NONFINITE_POLICIES", "NonFinite", "OptimizerStep", "step_oom_error", "step_optimizer"]

#: what a step with inf/NaN gradients does: raise NonFiniteError before the optimizer step, or skip it
NonFinite = Literal["stop", "skip"]
NONFINITE_POLICIES: tuple[str, ...] = get_args(NonFinite)


@dataclass(frozen=True)
class OptimizerStep:
    """What the optimizer step did.

    Attributes:
        grad_norm: the total gradient norm before clipping (a device tensor, read after the step's
            launch), None without clipping.
        skipped: the optimizer did not step, for inf/NaN gradients: found by the GradScaler (fp16) or
            by the check (the scheduler did not step either).
        nonfinite: the check found inf/NaN in the gradients or the loss (the step was not taken).
        loss: the step's loss as the check read it with its flags, before ``optimizer.step()`` was
            launched (None without the check): nothing waits for the optimizer to read it again.
    """

    grad_norm: torch.Tensor | float | None
    skipped: bool
    nonfinite: bool = False
    loss: float | None = None


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
                   micro_batch: int = 0, check_finite: bool = False, loss: torch.Tensor | float | None = None,
                   sync: GradSync | None = None) -> OptimizerStep:
    """Unscale (once), check, clip (once), step and update the scaler; step the scheduler unless skipped.

    Args:
        optimizer: the optimizer to step.
        params: every parameter the step computed a gradient for (clipped and checked together).
        scaler: a GradScaler (fp16): unscaled before clipping, then ``scaler.step`` and ``update``.
        scheduler: stepped after the optimizer, unless the step was skipped.
        max_grad_norm: clip the total gradient norm to this (None: no clipping).
        step_number: the optimizer step's number, for the error message.
        micro_batch: the plan's micro-batch, for the error message.
        check_finite: without a scaler, skip the step (``nonfinite=True``) when a gradient or
            ``loss`` holds inf/NaN (see the module docstring).
        loss: the step's loss (a device tensor or a float), checked with the gradients.
        sync: how the ranks agree on the check where each holds a shard of the gradients (FSDP2).

    Returns:
        What the step did: the gradient norm, and whether it was skipped.

    Raises:
        OptimizerStepOOMError: out of memory in unscaling, clipping or ``optimizer.step()``.
    """
    phase = ["GradScaler.unscale_"]

    def run() -> OptimizerStep:
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm, read = None, Read(None, None)
        if check_finite and scaler is None:
            phase[0] = "gradient clipping" if max_grad_norm is not None else "the inf/NaN check"
            finite, norm, read = _check_finite(params, loss, max_grad_norm, sync)
            if not finite:
                return OptimizerStep(None, True, nonfinite=True, loss=read.loss)
        if max_grad_norm is not None:
            phase[0] = "gradient clipping"
            if norm is None:
                norm = torch.nn.utils.clip_grad_norm_(list(params), max_grad_norm)  # read after the step
            else:  # the total norm the check computed: clip with it, not a second pass over the gradients
                torch.nn.utils.clip_grads_with_norm_(list(params), max_grad_norm, norm)
        phase[0] = "optimizer.step()"
        if scaler is None:
            optimizer.step()
            return OptimizerStep(norm if read.norm is None else read.norm, False, loss=read.loss)
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


class Read(NamedTuple):
    """What the check read on the host with its flags: the loss and the total norm (None: not read)."""

    loss: float | None
    norm: float | None


def _check_finite(params: Sequence[torch.nn.Parameter], loss: torch.Tensor | float | None,
                  max_grad_norm: float | None, sync: GradSync | None) -> tuple[bool, torch.Tensor | None, Read]:
    """Whether every gradient and the loss are finite: one fused reduction, one read on the host.

    Returns (finite, the total 2-norm for clipping or None, the loss and norm read with the flags).
    The read is the step's one wait for the device: the loss and the norm travel with the flags, so
    that nothing reads the device again after ``optimizer.step()`` is launched (the next step's host
    work runs while the device steps the optimizer, as in a hand-written loop). The reduction is the 2-norm of each
    gradient (``torch._foreach_norm``: one pass over the gradients; a NaN or inf element makes it
    non-finite); with clipping, the total norm clipping needs anyway, so the check costs no second
    pass. A norm can also overflow where every element is finite (fp32 beyond ~1.8e19, fp16 beyond
    65504): only then, and only on a non-finite norm, are the elements looked at one by one.
    (``ord=inf`` cannot overflow, but is a much slower reduction on the CPU.) FSDP2 gradients are
    DTensor shards: each rank reduces its own shard (no collective inside) and the ranks exchange
    one number."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = any(hasattr(g, "to_local") for g in grads)
    if sharded:
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # type: ignore[operator]
    clip_norm = max_grad_norm is not None and not sharded
    total: torch.Tensor | None = None
    parts: list[torch.Tensor] = []  # read on the host in one go: all finite, or not
    if grads and clip_norm:
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        parts.append(total.reshape(1))
    elif grads:
        device = grads[0].device
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        norms = [n.to(device) for group in groups.values() for n in torch._foreach_norm(group, 2.0)]
        parts.append(torch.stack(norms).max().reshape(1))  # an inf or NaN norm carries through the max
    if isinstance(loss, torch.Tensor):
        parts.append(loss.detach().reshape(1))
    row: list[float] = []
    if parts:
        dtype = torch.float32 if parts[0].device.type == "mps" else torch.float64  # MPS has no float64
        row = torch.cat([t.to(parts[0].device, dtype) for t in parts]).tolist()  # the one read on the host
    finite = all(math.isfinite(v) for v in row)
    read = Read(row[-1] if isinstance(loss, torch.Tensor) else None, row[0] if total is not None else None)
    if isinstance(loss, float):
        finite = finite and math.isfinite(loss)
    if not finite and grads:
        finite = _elements_finite(grads, loss)
    if sharded and sync is not None and sync.world_size > 1:
        flag = torch.tensor([0.0 if finite else 1.0], dtype=torch.float64)
        finite = float(sync.sum_items(flag)[0]) == 0.0  # one rank's non-finite shard stops every rank
    return finite, total, read


def _elements_finite(grads: list[torch.Tensor], loss: torch.Tensor | float | None) -> bool:
    """After a non-finite reduction: a non-finite loss, or a sum (or norm) that overflowed where every
    element is finite, or an inf/NaN element? (rare: the elements looked at one by one)"""
    if loss is not None and not math.isfinite(float(loss)):
        return False
    return all(bool(torch.isfinite(g).all()) for g in grads)
