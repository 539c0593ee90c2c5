"""Every all-reduce a rank issues from Python, seen where all of them meet: ``ProcessGroup.allreduce``.

``dist.all_reduce`` calls it, and DDP's reducer sends its buckets to it directly, so a test that watches
collectives watches it there. Whether the caller holds
the work handle and waits on it later (sent ahead) is what ``dist.all_reduce`` was asked
(``async_op``), or for a call made to the group directly, what its options say (``asyncOp``; on a
torch without that field only the buckets call the group directly, and they are sent ahead).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

#: (the call's tensors, sent ahead, the call itself: returns its work handle) -> what the caller gets
Handler = Callable[[list[torch.Tensor], bool, Callable[[], Any]], Any]

_asked = threading.local()  # the async_op of the dist.all_reduce call in progress on this thread, if any


def intercept_all_reduces(handler: Handler) -> Callable[[], None]:
    """Route every all-reduce this process issues from Python through ``handler``; returns what undoes it."""
    real_dist, real_group = dist.all_reduce, dist.ProcessGroup.allreduce
    # what the class itself holds: pybind's method wrapper, which binds ``self``. Reading it through the
    # class gives the bare function, which set back on the class would no longer bind: every later
    # ``group.allreduce(...)`` in this process would fail for want of its group
    held = vars(dist.ProcessGroup)["allreduce"]

    def through_dist(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        _asked.value = async_op
        try:
            return real_dist(tensor, *args, async_op=async_op, **kwargs)
        finally:
            _asked.value = None

    def at_group(group: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        asked, _asked.value = getattr(_asked, "value", None), None
        opts = args[0] if args else kwargs.get("opts")
        sent_ahead = asked if asked is not None else bool(getattr(opts, "asyncOp", True))
        listed = tensors if isinstance(tensors, list) else [tensors]
        return handler(listed, sent_ahead, lambda: real_group(group, tensors, *args, **kwargs))

    dist.all_reduce = through_dist  # type: ignore[assignment]
    dist.ProcessGroup.allreduce = at_group  # type: ignore[method-assign]

    def undo() -> None:
        dist.all_reduce = real_dist  # type: ignore[assignment]
        dist.ProcessGroup.allreduce = held  # type: ignore[method-assign]

    return undo


@contextlib.contextmanager
def recording_all_reduces(calls: list[tuple[Any, ...]],
                          describe: Callable[[torch.Tensor], tuple[Any, ...]] = lambda t: (t.numel(), str(t.dtype)),
                          ) -> Iterator[None]:
    """Within the block, every all-reduce this process issues from Python appended to ``calls`` as
    ``(*describe(tensor), sent ahead)``, one entry per tensor (by default its elements and dtype).
    DDP's reducer issues its own from C++: not seen (and none runs under no_sync)."""
    def record(tensors: list[torch.Tensor], sent_ahead: bool, call: Callable[[], Any]) -> Any:
        calls.extend((*describe(t), sent_ahead) for t in tensors)
        return call()

    undo = intercept_all_reduces(record)
    try:
        yield
    finally:
        undo()
