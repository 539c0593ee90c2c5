"""One place that decides whether an exception means "out of memory"."""

from __future__ import annotations

import torch

__all__ = ["is_oom"]

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
