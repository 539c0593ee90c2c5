"""Out-of-memory errors: the one place that tells one (``is_oom``), and the one way autoaccum recovers.

An exception's traceback holds the frames of the failed attempt, and those frames hold its
activations. Recovery -- freeing memory, replaying, shrinking -- therefore happens only after the
``except`` block is left, when the exception and its traceback are gone. Three pieces, used by the
probe, the guard, the optimizer step, the evaluation and the search:

- ``drop_frames`` clears the locals of the frames an OOM unwound, inside the ``except`` block: a
  frame caught in a reference cycle then holds no tensor, and the activations die by reference
  counting when the exception is dropped, with no garbage collection.
- ``catch_oom`` runs a function and turns an OOM into a returned flag: the caller recovers outside
  any ``except`` block. Other exceptions pass through unchanged.
- ``release_memory`` frees what a failed attempt left. A full garbage collection walks every object
  of the process (hundreds of thousands once torch is imported), so it runs only where needed: not
  at all where the meter shows the live bytes back at the step's start, else the young generations
  first (where the failed attempt's frames are) and a full collection only if memory is still
  missing. On CUDA the allocator's cached blocks go back to the driver.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch

from autoaccum.memory import Meter

__all__ = ["is_oom", "Released", "catch_oom", "drop_frames", "release_memory"]

# Backends that raise a plain RuntimeError for an allocation failure. Each entry is a message
# fragment seen from that backend; nothing broader, so that e.g. "illegal memory access" (a crash,
# not a shortage) never counts as OOM.
_OOM_MESSAGES = (
    "CUDA out of memory",  # torch < 2.1 raised RuntimeError before torch.OutOfMemoryError existed
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace allocation
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN workspace allocation
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator failure
    "MPS backend out of memory",  # Apple MPS
    "XPU out of memory",  # Intel XPU
)


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` reports that an allocation failed for lack of memory."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if type(exc) is RuntimeError:  # only the plain class: subclasses mean something else
        message = str(exc)
        return any(fragment in message for fragment in _OOM_MESSAGES)
    return False


T = TypeVar("T")

#: what ``release_memory`` did: nothing to collect, the young generations, or everything
Released = Literal["none", "young", "full"]


def drop_frames(exc: BaseException) -> None:
    """Clear the locals of every frame ``exc`` unwound (``traceback.clear_frames``; the frame still
    running, the one that caught it, is left alone). Call it in the ``except`` block of an OOM
    that is recovered from, never for an error that is re-raised (its locals are the user's
    evidence)."""
    traceback.clear_frames(exc.__traceback__)


def catch_oom(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T | None, bool]:
    """``(fn(*args, **kwargs), False)``, or ``(None, True)`` when it ran out of memory.

    The exception is dropped inside this frame (its frames' locals cleared first), so by the time
    the caller sees ``True`` nothing refers to the failed attempt's tensors any more."""
    try:
        return fn(*args, **kwargs), False
    except Exception as exc:  # noqa: BLE001 - only OOM is caught; everything else is re-raised
        if not is_oom(exc):
            raise
        drop_frames(exc)
    return None, True


def _missing(meter: Meter | None, start_bytes: int | None) -> bool | None:
    """Whether the meter shows more bytes live than at the start (None: it cannot say)."""
    reading = meter.read() if meter is not None else None
    if reading is None or start_bytes is None:
        return None
    return reading.current_bytes > start_bytes


def release_memory(device: torch.device, meter: Meter | None = None, start_bytes: int | None = None, *,
                   thorough: bool = True) -> Released:
    """Free what a failed attempt left (call outside the ``except`` block).

    Args:
        device: where the attempt ran (CUDA: cached blocks go back to the driver).
        meter: reads the live bytes now; with ``start_bytes`` it decides whether to collect.
        start_bytes: the bytes live before the attempt. When the meter shows no more than that,
            memory came back by reference counting and nothing is collected.
        thorough: where no meter can say whether memory came back, collect everything (the
            default) rather than the young generations only. The guard collects the young ones
            first and everything when the same step runs out of memory a second time.

    Returns:
        What was collected: ``"none"``, ``"young"`` (generations 0 and 1) or ``"full"``.
    """
    released: Released = "none"
    missing = _missing(meter, start_bytes)
    if missing is None:  # no meter to read
        gc.collect() if thorough else gc.collect(1)
        released = "full" if thorough else "young"
    elif missing:
        gc.collect(1)  # the failed attempt's objects are young: cheap, and usually enough
        released = "young"
        if _missing(meter, start_bytes):  # still missing: a cycle reaching older objects
            gc.collect()
            released = "full"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return released
