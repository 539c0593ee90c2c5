"""The memory model: ``peak(b) = max(opt_peak, base + per_sample * b)``, fitted on measured phases;
for variable-length data ``peak(b, L) = max(opt_peak, base + b * (a * L + c * L**2))``.

A training step has two peaks. The forward/backward peak holds weights, gradients, optimizer
state and the activations of ``b`` samples, so it grows linearly in ``b``. The optimizer-step peak
holds weights, gradients, state and the optimizer's temporaries (about 16-20 bytes per parameter
with AdamW) and does not depend on ``b``. One straight line fitted to the overall peak at small
``b`` (where the optimizer peak dominates) under-predicts large ``b`` badly, so the two phases
are measured apart and fitted apart.
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
            raise ValueError(f"fitting the memory model needs at least 2 distinct micro-batch sizes, got {sorted(by_size)}")
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
        """True when the points follow the model (three or more points within GOOD_FIT_RESIDUAL)."""
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
    """Fitted ``peak(b, L) = max(opt_peak, base + b * (per_token * L + per_token_sq * L**2))``.

    For variable-length data memory follows the tokens of a micro-batch (``b`` samples padded to
    ``L``), and -- where attention runs without a fused kernel -- their square. The quadratic term
    is kept only where the measurements show one: it must be positive and cut the worst relative
    error of the linear fit at least in half.

    Attributes:
        base_bytes: what does not grow with the tokens (weights, gradients, state).
        per_token_bytes: bytes per token of a micro-batch.
        per_token_sq_bytes: bytes per sample per squared length (0 when the data show none).
        opt_peak_bytes: the optimizer-step peak.
        residual: worst relative error of the fit on its points.
        num_points: measurements it was fitted on.
    """

    base_bytes: float
    per_token_bytes: float
    per_token_sq_bytes: float
    opt_peak_bytes: int
    residual: float
    num_points: int

    @classmethod
    def fit(cls, points: Sequence[TokenPoint]) -> TokenMemoryModel:
        """Least squares on the forward/backward peaks; needs three points at two or more lengths."""
        if len(points) < 3 or len({p.length for p in points}) < 2:
            raise ValueError(f"fitting the token memory model needs 3 points at 2 or more lengths, got "
                             f"{[(p.micro_batch, p.length) for p in points]}")
        linear = cls._least_squares(points, quadratic=False)
        best = linear
        if len({p.length for p in points}) >= 3 and len(points) >= 4:
            quadratic = cls._least_squares(points, quadratic=True)
            if quadratic.per_token_sq_bytes > 0 and quadratic.residual <= linear.residual / 2:
                best = quadratic
        return best

    @classmethod
    def _least_squares(cls, points: Sequence[TokenPoint], quadratic: bool) -> TokenMemoryModel:
        import torch  # float64 least squares on a handful of points

        rows = [[1.0, p.micro_batch * p.length] + ([p.micro_batch * p.length ** 2] if quadratic else [])
                for p in points]
        x = torch.tensor(rows, dtype=torch.float64)
        y = torch.tensor([[float(p.fwd_bwd_peak_bytes)] for p in points], dtype=torch.float64)
        coef = torch.linalg.lstsq(x, y).solution.flatten().tolist()
        base, per_token, per_sq = coef[0], max(coef[1], 0.0), (max(coef[2], 0.0) if quadratic else 0.0)
        residual = max(abs(base + p.micro_batch * (per_token * p.length + per_sq * p.length ** 2)
                           - p.fwd_bwd_peak_bytes) / max(p.fwd_bwd_peak_bytes, 1) for p in points)
        return cls(base, per_token, per_sq, max(p.opt_peak_bytes for p in points), residual, len(points))

    @property
    def quadratic(self) -> float:
        """The quadratic term per token: ``per_token_sq / per_token``."""
        return self.per_token_sq_bytes / self.per_token_bytes if self.per_token_bytes > 0 else 0.0

    def predict(self, micro_batch: int, length: int) -> int:
        """Predicted peak bytes of a training step of ``micro_batch`` samples padded to ``length``."""
        grows = micro_batch * (self.per_token_bytes * length + self.per_token_sq_bytes * length ** 2)
        return int(math.ceil(max(self.opt_peak_bytes, self.base_bytes + grows)))

    def max_cost(self, budget_bytes: int, headroom: float = 0.0) -> float:
        """The token-units (``b * (L + quadratic * L**2)``) a micro-batch may hold; 0 if none."""
        usable = usable_bytes(budget_bytes, headroom)
        if self.opt_peak_bytes > usable or self.per_token_bytes <= 0:
            return 0.0
        return max(0.0, (usable - self.base_bytes) / self.per_token_bytes)

    def max_batch(self, length: int, budget_bytes: int, headroom: float = 0.0) -> int:
        """The largest micro-batch of samples padded to ``length`` predicted to fit; 0 if none."""
        return int(self.max_cost(budget_bytes, headroom) // (length + self.quadratic * length * length))

    def to_dict(self) -> dict[str, float | int]:
        return {"base_bytes": self.base_bytes, "per_token_bytes": self.per_token_bytes,
                "per_token_sq_bytes": self.per_token_sq_bytes, "opt_peak_bytes": self.opt_peak_bytes,
                "residual": self.residual, "num_points": self.num_points}

    @classmethod
    def from_dict(cls, data: dict) -> TokenMemoryModel:
        return cls(float(data["base_bytes"]), float(data["per_token_bytes"]), float(data["per_token_sq_bytes"]),
                   int(data["opt_peak_bytes"]), float(data["residual"]), int(data["num_points"]))
