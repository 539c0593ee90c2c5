"""What the guard's calls return: plain values (``OOMGuard.step`` a ``StepResult``, ``OOMGuard.accumulate`` an
``AccumulateResult``)."""

from __future__ import annotations

from dataclasses import dataclass

from autoaccum.guard.policy import PlanChange
from autoaccum.plan.plan import Plan

__all__ = ["AccumulateResult", "StepResult"]


@dataclass(frozen=True)
class AccumulateResult:
    """What one ``OOMGuard.accumulate`` did; the parameters' ``.grad`` hold the global batch's gradient.

    Attributes:
        loss: the step's loss, weighted by samples (or items) exactly as a full-batch step's.
        num_samples: samples in the step over all ranks.
        num_items: items (e.g. tokens) over all ranks for token-level losses, else None.
        plan: the plan in force after the step.
        changes: plan changes during the step (OOM replays, thrash, growth).
        attempts: forward/backward passes over the batch (1 + OOM replays).
        step_time_s: wall time of the whole step, replays included.
        peak_bytes: peak memory of the step (the meter's), else None.
        micro_steps: micro-steps of the attempt that succeeded (on every rank; with a token budget
            it depends on the step's lengths).
    """

    loss: float
    num_samples: int
    num_items: int | None
    plan: Plan
    changes: tuple[PlanChange, ...]
    attempts: int
    step_time_s: float
    peak_bytes: int | None
    micro_steps: int = 0


@dataclass(frozen=True)
class StepResult(AccumulateResult):
    """What one ``OOMGuard.step`` did: ``AccumulateResult``, and the optimizer step.

    Attributes:
        grad_norm: total gradient norm before clipping (when clipping), else None.
        skipped: the optimizer step was skipped for inf/NaN gradients: by the GradScaler (fp16), or
            under ``nonfinite="skip"`` (the weights, optimizer state and scheduler are unchanged).
        lr: learning rate of the first parameter group used by the step.
    """

    grad_norm: float | None = None
    skipped: bool = False
    lr: float = 0.0
