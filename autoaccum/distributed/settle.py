"""Collectives that leave nothing behind: wait until torch.distributed's worker thread has let go of a
collective's tensors before going on.

Why. gloo runs each collective on a worker thread of the process group. A collective call returns
when its result is ready, but the worker drops its own reference to the collective (and so to its
tensors) when it finishes, which can be after the call has returned. If the caller has dropped the
tensor by then, the worker thread frees it, and freeing a tensor that has a Python object needs the
GIL. When that moment falls inside interpreter shutdown the thread cannot take the GIL: Python ends
it (``pthread_exit``), the unwinding meets a ``noexcept`` destructor, and the process aborts with
"terminate called without an active exception" after all its work is done.

So autoaccum holds every tensor it hands to a collective until the backend's reference is gone (the
tensor's use count is back to what it was before the call): when one of its calls returns, none of
its collectives is in flight and no worker thread holds its tensors. The wait is short (the worker
needs no GIL to drop a reference we still hold) and bounded; it applies to CPU tensors, where a
finished gloo collective is really finished. CUDA collectives (nccl) complete on the GPU stream
later and are left to the backend and ``destroy_process_group()``.

Your own collectives get the same guarantee with ``settled``::

    with autoaccum.distributed.settled() as keep:
        dist.all_reduce(keep(total))
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import torch

__all__ = ["settled"]

logger = logging.getLogger(__name__)

#: how long to wait for a worker thread to drop a tensor before giving up (then: a warning, no error)
SETTLE_TIMEOUT_S = 5.0
_YIELDS = 200  # first yield the CPU (sleep(0)), then sleep briefly: the worker needs a core, not the GIL


def _use_count(t: torch.Tensor) -> int | None:
    """How many C++ references the tensor has (None where this torch has no ``Tensor._use_count``)."""
    count = getattr(t, "_use_count", None)
    return None if count is None else int(count())


@contextlib.contextmanager
def settled(*tensors: torch.Tensor, timeout_s: float = SETTLE_TIMEOUT_S) -> Iterator[Callable[[torch.Tensor],
                                                                                               torch.Tensor]]:
    """Run collectives on ``tensors`` (and on what ``keep`` is given) and return only once the
    process group's worker threads no longer hold any of them.

    On leaving, waits until every noted CPU tensor's use count is back to what it was when noted.

    Args:
        tensors: the tensors the block's collectives run on, known before it.
        timeout_s: how long to wait; then it stops waiting with a warning (the collective is done;
            only an abort at exit stays possible).

    Yields:
        ``keep``: ``keep(t)`` notes ``t`` (its use count now) and returns it, for tensors made inside
        the block.
    """
    noted: list[tuple[torch.Tensor, int]] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        count = _use_count(t)
        if count is not None and t.device.type == "cpu":
            noted.append((t, count))
        return t

    for t in tensors:
        keep(t)
    yield keep
    _wait(noted, timeout_s)


def _wait(noted: list[tuple[torch.Tensor, int]], timeout_s: float) -> None:
    deadline, spins = None, 0
    for t, before in noted:
        while t._use_count() > before:
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout_s
            elif now > deadline:
                logger.warning("torch.distributed still holds a collective's tensor %.1f s after the call returned; "
                               "going on without waiting (if the process exits now it may abort)", timeout_s)
                return
            time.sleep(0 if spins < _YIELDS else 1e-4)
            spins += 1
