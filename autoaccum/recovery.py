"""Recovering from an out-of-memory error: the one way autoaccum does it.

An exception's traceback holds the frames of the failed attempt, and those frames hold its
activations. Recovery -- freeing memory, replaying, shrinking -- therefore happens only after the
``except`` block is left, when the exception and its traceback are gone (house rule 9). Two
pieces, used by the probe, the guard, the optimizer step, the evaluation and the search:

- :func:`catch_oom` runs a function and turns an OOM into a returned flag: the caller recovers
  outside any ``except`` block. Other exceptions pass through unchanged.
- :func:`release_memory` frees what a failed attempt left: a garbage collection only when the
  meter shows that memory did not come back by reference counting (frames of a failed attempt can
  sit in reference cycles; a full collection costs tens of milliseconds to seconds in a big
  process), and the CUDA allocator's cached blocks.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from autoaccum.memory import Meter
from autoaccum.oom import is_oom

__all__ = ["catch_oom", "release_memory"]

T = TypeVar("T")


def catch_oom(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T | None, bool]:
    """``(fn(*args, **kwargs), False)``, or ``(None, True)`` when it ran out of memory.

    The exception is dropped inside this frame, so by the time the caller sees ``True`` nothing
    refers to the failed attempt's tensors any more."""
    try:
        return fn(*args, **kwargs), False
    except Exception as exc:  # noqa: BLE001 - only OOM is caught; everything else is re-raised
        if not is_oom(exc):
            raise
    return None, True


def release_memory(device: torch.device, meter: Meter | None = None, start_bytes: int | None = None) -> None:
    """Free what a failed attempt left (call outside the ``except`` block).

    Args:
        device: where the attempt ran (CUDA: cached blocks go back to the driver).
        meter: reads the live bytes now; with ``start_bytes`` it decides whether to collect.
        start_bytes: the bytes live before the attempt. When the meter shows no more than that,
            memory came back by reference counting and the collection is skipped.
    """
    reading = meter.read() if meter is not None else None
    if reading is None or start_bytes is None or reading.current_bytes > start_bytes:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
