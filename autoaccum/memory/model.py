"""The memory model: ``peak(b) = max(opt_peak, base + per_sample * b)``, fitted on measured phases;
for variable-length data ``peak(b, L) = max(opt_peak, base + b * (per_sample + a * L + c * L**2))``.

A training step has two peaks. The forward/backward peak holds weights, gradients, optimizer
state and the activations of ``b`` samples, so it grows linearly in ``b``. The optimizer-step peak
holds weights, gradients, state and the optimizer's temporaries, and does not depend on ``b``. One
straight line fitted to the overall peak at small ``b`` (where the optimizer peak dominates)
under-predicts large ``b`` badly, so the two phases are measured apart and fitted apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autoaccum.memory import usable_bytes

__all__ = ["GOOD_FIT_RESIDUAL", "MemoryModel", "MemoryPoint", "TokenMemoryModel", "TokenPoint"]

#: the largest relative error of the line on its own points for which the model is trusted
GOOD_FIT_RESIDUAL = 0.05


@dataclass(frozen=True)
class MemoryPoint:
    """One measured micro-batch size: the peak of its forward/backward and of its optimizer step."""

    micro_batch: int
    fwd_bwd_peak_bytes: int
    opt_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.fwd_bwd_peak_bytes, self.opt_peak_bytes)


@dataclass(frozen=True)
class MemoryModel:
    """Fitted ``peak(b) = max(opt_peak_bytes, base_bytes + per_sample_bytes * b)``.

    Attributes:
        base_bytes: intercept of the forward/backward line (weights, gradients, state, ...).
        per_sample_bytes: slope of the forward/backward line (activations per sample).
        opt_peak_bytes: the optimizer-step peak (largest measured).
        residual: largest relative error of the line on the points it was fitted on.
        num_points: how many distinct micro-batch sizes the line was fitted on.
    """

    base_bytes: float
    per_sample_bytes: float
    opt_peak_bytes: int
    residual: float
    num_points: int

    @classmethod
    def fit(cls, points: Sequence[MemoryPoint]) -> MemoryModel:
        """Least squares on the forward/backward peaks; needs two distinct sizes."""
        by_size: dict[int, MemoryPoint] = {}
        for p in points:  # repeated sizes: keep the larger peaks (the conservative reading)
            old = by_size.get(p.micro_batch)
            by_size[p.micro_batch] = p if old is None else MemoryPoint(
                p.micro_batch, max(old.fwd_bwd_peak_bytes, p.fwd_bwd_peak_bytes),
                max(old.opt_peak_bytes, p.opt_peak_bytes))
        if len(by_size) < 2:
            raise ValueError(f"fitting the memory model needs at least 2 distinct micro-batch sizes, "
                             f"got {sorted(by_size)}")
        xs = [float(b) for b in by_size]
        ys = [float(p.fwd_bwd_peak_bytes) for p in by_size.values()]
        n = len(xs)
        mean_x, mean_y = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
        slope = max(slope, 0.0)  # memory never shrinks with more samples; noise must not say so
        intercept = mean_y - slope * mean_x
        residual = max(abs(intercept + slope * x - y) / max(y, 1.0) for x, y in zip(xs, ys))
        opt_peak = max(p.opt_peak_bytes for p in by_size.values())
        return cls(intercept, slope, opt_peak, residual, n)

    @property
    def is_good_fit(self) -> bool:
        """True when the line's residual on its own points is within GOOD_FIT_RESIDUAL."""
        return self.residual <= GOOD_FIT_RESIDUAL

    def predict(self, micro_batch: int) -> int:
        """Predicted peak bytes of a training step with ``micro_batch`` samples."""
        return int(math.ceil(max(self.opt_peak_bytes, self.base_bytes + self.per_sample_bytes * micro_batch)))

    def max_batch(self, budget_bytes: int, headroom: float = 0.0) -> int:
        """The largest micro-batch predicted to fit in ``budget_bytes * (1 - headroom)``; 0 if none."""
        usable = usable_bytes(budget_bytes, headroom)
        if self.opt_peak_bytes > usable:
            return 0
        if self.per_sample_bytes <= 0:
            return 2**31  # nothing grows with b: the caller caps it
        return max(0, int(math.floor((usable - self.base_bytes) / self.per_sample_bytes)))

    def to_dict(self) -> dict[str, float | int]:
        return {"base_bytes": self.base_bytes, "per_sample_bytes": self.per_sample_bytes,
                "opt_peak_bytes": self.opt_peak_bytes, "residual": self.residual, "num_points": self.num_points}

    @classmethod
    def from_dict(cls, data: dict) -> MemoryModel:
        return cls(float(data["base_bytes"]), float(data["per_sample_bytes"]), int(data["opt_peak_bytes"]),
                   float(data["residual"]), int(data["num_points"]))


@dataclass(frozen=True)
class TokenPoint:
    """One measured micro-batch of ``micro_batch`` samples padded to ``length``."""

    micro_batch: int
    length: int
    fwd_bwd_peak_bytes: int
    opt_peak_bytes: int


@dataclass(frozen=True)
class TokenMemoryModel:
    """Fitted ``peak(b, L) = max(opt_peak, base + b * (per_sample + per_token * L + per_token_sq * L**2))``.

    For variable-length data memory follows the tokens of a micro-batch (``b`` samples padded to
    ``L``), and -- where attention runs without a fused kernel -- their square; ``per_sample`` is
    what a sample costs whatever its length (positive for a per-sample head, negative where a
    sequence's last position predicts nothing). The intercept and the cost per sample at the
    longest length come from the line through sizes near the limit there; the shape in ``L`` is
    fitted on one size per shorter length, where that size came near the budget (a size of few
    tokens peaks elsewhere in the step): through two lengths a line, through three or more a
    parabola (kept only where its curvature is positive), through the longest alone a line
    through the origin.

    Attributes:
        base_bytes: what does not grow with the micro-batch (weights, gradients, state).
        per_token_bytes: bytes per token of a micro-batch.
        per_token_sq_bytes: bytes per sample per squared length (0 when the data show none).
        per_sample_bytes: bytes per sample whatever its length (may be negative).
        opt_peak_bytes: the optimizer-step peak.
        residual: worst relative error on the points it was fitted on.
        num_points: measurements it was fitted on.
    """

    base_bytes: float
    per_token_bytes: float
    per_token_sq_bytes: float
    opt_peak_bytes: int
    residual: float
    num_points: int
    per_sample_bytes: float = 0.0

    @classmethod
    def anchored(cls, base_bytes: float, per_sample_bytes: float, longest: int, opt_peak_bytes: int,
                 points: Sequence[TokenPoint] = ()) -> TokenMemoryModel:
        """The model through ``base + b * per_sample_bytes`` at ``longest``, its shape in ``L`` from
        ``points`` (one or more sizes at shorter lengths near the budget)."""
        import torch  # float64 least squares on a handful of points

        costs = {longest: per_sample_bytes}  # what a sample adds, by length
        for p in points:
            if 0 < p.length < longest and p.micro_batch > 0:
                costs[p.length] = max(costs.get(p.length, 0.0), (p.fwd_bwd_peak_bytes - base_bytes) / p.micro_batch)
        lengths = sorted(costs)
        d, a, c = 0.0, per_sample_bytes / longest, 0.0
        if len(lengths) >= 2:
            degree = 2 if len(lengths) >= 3 else 1
            x = torch.tensor([[float(n) ** k for k in range(degree + 1)] for n in lengths], dtype=torch.float64)
            y = torch.tensor([[costs[n]] for n in lengths], dtype=torch.float64)
            coef = torch.linalg.lstsq(x, y).solution.flatten().tolist()
            if degree == 2 and coef[2] < 0:  # a concave fit: the line through the lengths instead
                x, degree = x[:, :2], 1
                coef = torch.linalg.lstsq(x, y).solution.flatten().tolist()
            d, a, c = coef[0], coef[1], (coef[2] if degree == 2 else 0.0)
            if a <= 0:  # memory that does not grow with the length: no model in tokens to speak of
                d, a, c = 0.0, per_sample_bytes / longest, 0.0
        used = [p for p in points if p.length in costs]
        residual = max((abs(base_bytes + p.micro_batch * (d + a * p.length + c * p.length ** 2) - p.fwd_bwd_peak_bytes)
                        / max(p.fwd_bwd_peak_bytes, 1) for p in used), default=0.0)
        return cls(base_bytes, a, c, opt_peak_bytes, residual, len(used) + 1, d)

    @property
    def quadratic(self) -> float:
        """The quadratic term per token: ``per_token_sq / per_token``."""
        return self.per_token_sq_bytes / self.per_token_bytes if self.per_token_bytes > 0 else 0.0

    @property
    def per_sample(self) -> float:
        """The per-sample term in token-units: ``per_sample / per_token``."""
        return self.per_sample_bytes / self.per_token_bytes if self.per_token_bytes > 0 else 0.0

    def predict(self, micro_batch: int, length: int) -> int:
        """Predicted peak bytes of a training step of ``micro_batch`` samples padded to ``length``."""
        grows = micro_batch * max(self.per_sample_bytes + self.per_token_bytes * length
                                  + self.per_token_sq_bytes * length ** 2, 0.0)
        return int(math.ceil(max(self.opt_peak_bytes, self.base_bytes + grows)))

    def max_cost(self, budget_bytes: int, headroom: float = 0.0) -> float:
        """The token-units (``b * (L + quadratic * L**2)``) a micro-batch may hold; 0 if none."""
        usable = usable_bytes(budget_bytes, headroom)
        if self.opt_peak_bytes > usable or self.per_token_bytes <= 0:
            return 0.0
        return max(0.0, (usable - self.base_bytes) / self.per_token_bytes)

    def max_batch(self, length: int, budget_bytes: int, headroom: float = 0.0) -> int:
        """The largest micro-batch of samples padded to ``length`` predicted to fit; 0 if none."""
        unit = max(length + self.quadratic * length * length + self.per_sample, 1e-9)
        return int(self.max_cost(budget_bytes, headroom) // unit)

    def to_dict(self) -> dict[str, float | int]:
        return {"base_bytes": self.base_bytes, "per_token_bytes": self.per_token_bytes,
                "per_token_sq_bytes": self.per_token_sq_bytes, "per_sample_bytes": self.per_sample_bytes,
                "opt_peak_bytes": self.opt_peak_bytes, "residual": self.residual, "num_points": self.num_points}

    @classmethod
    def from_dict(cls, data: dict) -> TokenMemoryModel:
        return cls(float(data["base_bytes"]), float(data["per_token_bytes"]), float(data["per_token_sq_bytes"]),
                   int(data["opt_peak_bytes"]), float(data["residual"]), int(data["num_points"]),
                   float(data.get("per_sample_bytes", 0.0)))
