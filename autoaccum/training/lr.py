"""Learning-rate rules: from the LR tuned for one global batch to the LR for another.

Invariant 5: the LR follows the global batch only. These functions take global batch sizes;
micro-batch size and accumulation steps (and so an OOM) never enter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from autoaccum.validate import check_non_negative_int, check_positive_float, check_positive_int, is_number

__all__ = ["LR_RULES", "LinearWarmup", "LrRule", "apply_lr_rule", "build_scheduler", "check_scheduler_factory",
           "scale_adam_hparams", "scale_lr", "warmup_lambda"]

LrRule = Literal["linear", "sqrt", "none", "adam_sde"]
LR_RULES: tuple[str, ...] = get_args(LrRule)


def scale_lr(base_lr: float, base_batch: int, batch: int, rule: LrRule) -> float:
    """The learning rate for global batch ``batch``, given ``base_lr`` tuned at ``base_batch``.

    With ``kappa = batch / base_batch``:

    - ``"linear"``: ``lr = base_lr * kappa``. Goyal et al. 2017, "Accurate, Large Minibatch SGD:
      Training ImageNet in 1 Hour" (arXiv:1706.02677). Assumes SGD (with momentum) and that one
      step on ``kappa`` times the samples does what ``kappa`` small steps would, i.e. the gradient
      changes little over those steps. That fails early in training, so use it with warmup
      (``warmup_lambda``); it also breaks down beyond a problem-dependent critical batch size.
    - ``"sqrt"``: ``lr = base_lr * sqrt(kappa)``. The learning-rate part of the square-root
      scaling rule of Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
      Algorithms" (NeurIPS 2022, arXiv:2205.10287), common for Adam-type optimizers. Assumes an
      adaptive optimizer (Adam, AdamW, RMSprop), whose update is normalised by the gradient's
      second moment, trained with a small LR where the paper's SDE approximation holds. The
      paper's full rule also changes betas and eps; here they stay as they are.
    - ``"adam_sde"``: the same LR as ``"sqrt"``; the rule also scales Adam's betas and eps,
      which this function cannot reach: get all of them from ``scale_adam_hparams``.
    - ``"none"``: ``lr = base_lr``. Assumes the LR is right for ``batch`` already (tuned at this
      batch, or scheduled by the caller).

    ``batch == base_batch`` returns ``base_lr`` unchanged under every rule.

    Args:
        base_lr: the learning rate tuned at ``base_batch``; finite and > 0.
        base_batch: the global batch ``base_lr`` was tuned for; an int >= 1.
        batch: the global batch of the run (samples per optimizer step, all ranks); an int >= 1.
        rule: one of ``LR_RULES``.

    Returns:
        The learning rate for ``batch``.

    Raises:
        ValueError: ``rule`` is not one of ``LR_RULES``, ``base_lr`` is not finite or <= 0,
            a batch is < 1.
        TypeError: ``base_lr`` is not a number, a batch is not an int.
    """
    if rule not in LR_RULES:
        raise ValueError(f"Invalid rule: {rule!r}. Allowed values: {', '.join(map(repr, LR_RULES))}")
    base_lr = check_positive_float(base_lr, "base_lr")
    check_positive_int(base_batch, "base_batch")
    check_positive_int(batch, "batch")
    kappa = batch / base_batch
    if rule == "linear":
        return base_lr * kappa
    if rule in ("sqrt", "adam_sde"):
        return base_lr * math.sqrt(kappa)
    return base_lr


def scale_adam_hparams(lr: float, betas: tuple[float, float], eps: float, base_batch: int,
                       batch: int) -> tuple[float, tuple[float, float], float]:
    """Adam/AdamW hyperparameters for global batch ``batch``, given ones tuned at ``base_batch``.

    The square-root scaling rule for Adam (Malladi et al. 2022, "On the SDEs and Scaling Rules for
    Adaptive Gradient Algorithms", NeurIPS 2022, arXiv:2205.10287). With ``kappa = batch / base_batch``:

    - ``lr' = lr * sqrt(kappa)``
    - ``1 - beta' = kappa * (1 - beta)`` for each beta, i.e. ``beta' = 1 - kappa * (1 - beta)``
    - ``eps' = eps / sqrt(kappa)``

    Why: the paper's SDE for Adam stays the same when the noise scale ``lr / sqrt(B)`` and
    ``(1 - beta) / lr**2`` are kept; ``eps`` scales like ``sqrt(v)``, the root of the gradient's
    second moment, whose noise part shrinks as ``1 / sqrt(B)``. Assumptions: small LR and
    ``1 - beta``, where the SDE approximates Adam (the regime the rule is derived in). Weight
    decay is not part of the rule and is left alone; note that PyTorch's AdamW decays by
    ``lr * weight_decay`` per step, so its decay per step changes with ``lr'``.

    Growing the batch shrinks the betas; the rule has no meaning once ``kappa * (1 - beta) > 1``
    (a negative beta), i.e. beyond ``batch = base_batch / (1 - beta)``: that raises. Bias
    correction and the step count are left to the optimizer.

    Args:
        lr: the learning rate tuned at ``base_batch``; finite and > 0.
        betas: ``(beta1, beta2)`` tuned at ``base_batch``; each in [0, 1).
        eps: Adam's epsilon tuned at ``base_batch``; finite and >= 0.
        base_batch: the global batch the hyperparameters were tuned for; an int >= 1.
        batch: the global batch of the run; an int >= 1.

    Returns:
        ``(lr', (beta1', beta2'), eps')``; the inputs unchanged when ``batch == base_batch``.

    Raises:
        ValueError: a value is outside its range, or ``batch`` is so large that a scaled beta
            would be negative.
        TypeError: a value has the wrong type.
    """
    lr = check_positive_float(lr, "lr")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas, start=1):
        if not is_number(beta):
            raise TypeError(f"beta{i} must be a float, got {beta!r} ({type(beta).__name__})")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta{i}: {beta!r}. Allowed range: 0 <= beta{i} < 1")
    check_positive_float(eps, "eps", minimum=0.0, inclusive=True)
    check_positive_int(base_batch, "base_batch")
    check_positive_int(batch, "batch")
    beta1, beta2 = float(betas[0]), float(betas[1])
    if batch == base_batch:  # exactly the inputs: 1 - (1 - beta) need not round back to beta
        return lr, (beta1, beta2), float(eps)

    kappa = batch / base_batch
    scaled = []
    for i, beta in enumerate((beta1, beta2), start=1):
        new_beta = 1.0 - kappa * (1.0 - beta)
        if new_beta < 0.0:
            raise ValueError(
                f"Invalid batch for the Adam square-root rule: {batch} is {kappa:g} x base_batch {base_batch}, "
                f"which makes beta{i} = 1 - {kappa:g} * (1 - {beta!r}) = {new_beta:g} < 0. The rule holds only "
                f"while batch <= base_batch / (1 - beta{i}) = {base_batch / (1.0 - beta):g}; use a smaller "
                f"global batch, a beta{i} closer to 1 at base_batch, or the 'sqrt' rule (LR only)."
            )
        scaled.append(new_beta)
    root = math.sqrt(kappa)
    return lr * root, (scaled[0], scaled[1]), eps / root


@dataclass(frozen=True)
class LinearWarmup:
    """LambdaLR multiplier: ``min(1, (step + 1) / warmup_steps)``; 1 throughout for 0 steps.

    A callable object rather than a closure, so that it pickles and ``LambdaLR.state_dict()``
    records ``warmup_steps`` (as a plain dict).
    """

    warmup_steps: int

    def __post_init__(self) -> None:
        check_non_negative_int(self.warmup_steps, "warmup_steps", hint=" (0: no warmup)")

    def __call__(self, step: int) -> float:
        if self.warmup_steps == 0:
            return 1.0
        return min(1.0, (step + 1) / self.warmup_steps)


def warmup_lambda(warmup_steps: int) -> LinearWarmup:
    """A ``torch.optim.lr_scheduler.LambdaLR`` multiplier for linear warmup.

    LambdaLR calls it with the number of scheduler steps taken so far (0 for the first optimizer
    step), so optimizer step ``k`` (0-based) runs at ``lr * min(1, (k + 1) / warmup_steps)``: from
    ``lr / warmup_steps`` up to the full ``lr`` at step ``warmup_steps - 1``, constant after.
    Goyal et al. 2017 pair this gradual warmup with the linear rule.

    Args:
        warmup_steps: optimizer steps to reach the full LR; an int >= 0 (0: no warmup).

    Raises:
        TypeError: ``warmup_steps`` is not an int.
        ValueError: ``warmup_steps`` is negative.
    """
    return LinearWarmup(warmup_steps)


def apply_lr_rule(optimizer: torch.optim.Optimizer, base_batch: int | None, batch: int, rule: LrRule) -> float:
    """Rescale every parameter group of ``optimizer`` from ``base_batch`` to the global ``batch``.

    Each group's ``lr`` (and for ``adam_sde`` its ``betas`` and ``eps``, where it has them) was tuned
    at ``base_batch``; nothing changes when ``base_batch`` is None or equals ``batch``. Invariant
    5: this depends on the global batch only. Returns the first group's learning rate.

    Raises:
        ValueError: ``adam_sde`` for an optimizer whose groups have no ``betas`` and ``eps`` (SGD: the rule would
            scale its lr only, silently less than asked), checked before any group changes.
    """
    if rule == "adam_sde" and base_batch is not None:
        plain = next((i for i, group in enumerate(optimizer.param_groups)
                      if "betas" not in group or "eps" not in group), None)
        if plain is not None:  # before any group changes
            raise ValueError(f"lr_rule='adam_sde' scales Adam's betas and eps, and {type(optimizer).__name__}'s param "
                             f"group {plain} has none; use lr_rule='sqrt' (the same lr rule) or 'linear' for "
                             f"{type(optimizer).__name__}, or an Adam-family optimizer (Adam, AdamW)")
    if base_batch is not None and base_batch != batch:
        for group in optimizer.param_groups:
            if rule == "adam_sde" and "betas" in group and "eps" in group:
                # Malladi et al. 2022: lr * sqrt(k), 1 - beta -> k * (1 - beta), eps / sqrt(k)
                group["lr"], group["betas"], group["eps"] = scale_adam_hparams(
                    group["lr"], tuple(group["betas"]), group["eps"], base_batch, batch)
            else:
                group["lr"] = scale_lr(group["lr"], base_batch, batch, rule)
    return float(optimizer.param_groups[0]["lr"])


_FACTORY = "scheduler=lambda optimizer, total_steps: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, total_steps)"


def check_scheduler_factory(factory: Any, warmup_steps: int) -> None:
    """``fit(scheduler=)``: a factory of the optimizer and the run's total steps, not a name or a scheduler already
    built (built before the lr rule set the lr, it would put the unscaled lr back at its first step).

    Raises:
        TypeError: not a callable, or a scheduler object.
        ValueError: with ``warmup_steps`` (two schedules of one lr).
    """
    if isinstance(factory, torch.optim.lr_scheduler.LRScheduler) or hasattr(factory, "step") and \
            hasattr(factory, "state_dict"):
        raise TypeError(f"scheduler= takes a factory, not a built {type(factory).__name__}: fit builds the scheduler "
                        f"on its optimizer after the lr rule set the lr (one built before would put the unscaled lr "
                        f"back). Pass {_FACTORY}")
    if not callable(factory):
        raise TypeError(f"scheduler={factory!r} is not a factory: scheduler= is called as scheduler(optimizer, "
                        f"total_steps) and returns a torch.optim.lr_scheduler.LRScheduler, e.g. {_FACTORY}")
    if warmup_steps:
        raise ValueError(f"warmup_steps={warmup_steps} and scheduler= are two schedules of one lr: give the scheduler "
                         f"its warmup (torch.optim.lr_scheduler.SequentialLR of a LinearLR and your schedule, "
                         f"milestones=[{warmup_steps}]), or leave scheduler= out")


def build_scheduler(factory: Any, optimizer: torch.optim.Optimizer, total_steps: int | None) -> Any:
    """``factory(optimizer, total_steps)``, checked: it returns a scheduler of ``optimizer`` that the guard can step.

    Raises:
        ValueError: the run's total steps are unknown (data of unknown length and no ``max_steps``).
        TypeError: it returned something else than a scheduler of this optimizer.
    """
    if total_steps is None:
        raise ValueError("scheduler= is built with the run's total optimizer steps, and they are unknown (data of no "
                         "known length and no max_steps): give max_steps=, or a DataLoader/Dataset with a length")
    built = factory(optimizer, total_steps)
    owner = getattr(built, "optimizer", optimizer)
    if not callable(getattr(built, "step", None)) or owner is not optimizer:
        what = f"a scheduler of another optimizer ({type(owner).__name__})" if owner is not optimizer else \
            f"a {type(built).__name__}"
        raise TypeError(f"scheduler(optimizer, total_steps) returned {what}; it must return a "
                        f"torch.optim.lr_scheduler.LRScheduler built on the optimizer it is given, e.g. {_FACTORY}")
    return built
