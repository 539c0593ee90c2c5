"""Precision: the one table from a precision name to its autocast dtype, and what each needs.

- ``fp32``: no autocast.
- ``bf16``: forward and loss under ``torch.autocast(dtype=torch.bfloat16)``; no scaler (bf16 has
  fp32's exponent range, so gradients do not underflow).
- ``fp16``: forward and loss under ``torch.autocast(dtype=torch.float16)`` and a
  ``torch.amp.GradScaler``, as training in fp16 must (small gradients underflow otherwise).

The probe, the guard, the search and ``fit`` all read this table, so a plan is measured under the
precision it trains with.
"""

from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import Any, Literal, get_args

import torch

from autoaccum.validate import check_choice

__all__ = ["AUTOCAST_DTYPES", "PRECISIONS", "Precision", "autocast", "autocast_dtype", "check_precision",
           "make_scaler", "precision_of"]

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
#: read-only: precision name -> autocast dtype (None: no autocast)
AUTOCAST_DTYPES = MappingProxyType({"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16})


def check_precision(precision: object, name: str = "precision") -> Precision:
    return check_choice(precision, name, PRECISIONS)  # type: ignore[return-value]


def autocast_dtype(precision: Precision) -> torch.dtype | None:
    """The autocast dtype of ``precision``; None for fp32."""
    return AUTOCAST_DTYPES[check_precision(precision)]


def precision_of(dtype: torch.dtype | None) -> Precision:
    """The precision name of an autocast dtype (None: fp32)."""
    for name, value in AUTOCAST_DTYPES.items():
        if value == dtype:
            return name  # type: ignore[return-value]
    raise ValueError(f"Invalid autocast dtype: {dtype}. Allowed: None (fp32), torch.bfloat16, torch.float16")


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``dtype`` on ``device``'s type; a no-op context for None (fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def make_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 (loss scaling); None for fp32 and bf16."""
    return torch.amp.GradScaler(device.type) if check_precision(precision) == "fp16" else None
