"""The gradient all-reduce overlapped with the last micro-batch's backward (DDP and plain modules),
and what keeps every rank's collectives in the same order whatever that micro-batch does.

gloo (and nccl) pair collectives by their order on the group: the k-th collective one rank issues
meets the k-th of every other rank. The guard's protocol keeps that order in both of its forms:

- **today's** (``autoaccum.distributed``): no gradient collective inside the accumulation window;
  the OOM flag, then the gradients, once every rank has said OK;
- **overlapped** (this module, where the guard found room for it): during the last micro-batch's
  backward each bucket of gradients is all-reduced asynchronously as soon as every gradient in it
  is final (post-accumulate-grad hooks), buckets strictly in their fixed order on every rank. After
  the micro-batches, whatever happened -- every backward done, or an OOM or error in any forward,
  loss or backward -- each rank issues the buckets it has not issued yet, in the same order (its
  local sums, or zeros after a failure), waits until every one of them is done, and only then
  exchanges the flag. So every rank issues exactly ``buckets + 1`` collectives between the cut's
  exchange (``autoaccum.cut_agreement``) and the end of the flag, in the same order, and none of the gradient collectives is still in flight
  when the flag is exchanged (the rule of DESIGN.md's Scale section holds in both forms): the flag
  can never meet a gradient all-reduce. The flag exchange also carries which parameters
  have a gradient on each rank, whether a gradient was accumulated twice in the last backward
  (below) and the step's loss sum and item count: one all-reduce (SUM, float64) where today's
  protocol has three (flag, presence, scalars). Then gloo's worker has let go of every buffer
  (``settle``): if any rank said OOM (or ERROR), every rank drops
  the reduced sums -- its own gradients were never touched, the buffers are separate -- and the
  guard replays the step as today (same samples, same result; the replay is not overlapped).

A parameter whose gradient is accumulated twice in one backward (a weight shared across two
reentrant checkpointed regions) would have been sent before it was final: the flag exchange tells
every rank, the sums are dropped, the step's gradients are reduced the old way (its local gradients
are intact) and overlap is switched off for this sync, with a warning. A parameter that gets no
gradient in the last micro-batch leaves its bucket waiting until after the backward (it is sent
then, in order); a parameter no rank used keeps ``grad=None``, as in one process.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autoaccum.distributed.process_group import _all_reduce, _comm_device
from autoaccum.distributed.settle import settled
from autoaccum.log import user_stacklevel
from autoaccum.oom import is_oom

__all__: list[str] = []  # internal: DistributedSync drives it

logger = logging.getLogger(__name__)


class _OverlappedReduce:
    """Flat buffers for every bucket (kept from step to step), the hooks of one overlapped attempt,
    its work handles, and the sums waiting to be copied back after the ranks agreed."""

    def __init__(self, params: list[torch.nn.Parameter], buckets: list[list[torch.nn.Parameter]], group: Any) -> None:
        self.params, self.buckets, self.group = params, buckets, group
        self.where = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        self.flats: list[torch.Tensor] | None = None
        self.disabled: str | None = None  # why overlap is off for good on this sync
        self.active = False  # between start() and finish()
        self.reduced: list[bool] | None = None  # after an agreed OK: which parameters have a sum to take
        self.late = False  # after an agreed OK: a gradient was late on some rank; reduce the old way
        self.early = 0  # buckets of the last attempt sent from inside its backward (the overlap itself)
        self._hooks: list[Any] = []
        self._stack = contextlib.ExitStack()
        self._keep: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._works: list[Any] = []
        self._waiting: list[int] = []
        self._fired: set[int] = set()
        self._next = 0
        self._late = False

    # -- the buffers -------------------------------------------------------------------------------
    def allocate(self) -> bool:
        """The flat buffers, allocated before any rank commits to an overlapped attempt; False (and
        nothing held) where that runs out of memory: this rank then votes against overlapping."""
        if self.flats is not None:
            return True
        try:
            self.flats = [torch.empty(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                          for b in self.buckets]
        except Exception as exc:  # noqa: BLE001 - an OOM means "no room to overlap"; anything else is raised
            if not is_oom(exc):
                raise
            oom = True
        else:
            oom = False
        if oom:  # outside the except block: the traceback holds nothing of ours then
            self.flats = None
            return False
        return True

    def release(self) -> None:
        """Give the buffers back (memory got tight): the next overlapped attempt allocates them again."""
        self.flats = None

    # -- one overlapped attempt ------------------------------------------------------------------------
    def start(self) -> Callable[[], None]:
        """Begin an attempt (every rank agreed to overlap it); returns ``arm``, to be called before the
        last micro-step's backward (the guard calls it when it hands out the last micro-batch)."""
        if self.flats is None or self.active:
            raise RuntimeError("internal: an overlapped attempt needs its buffers and no attempt in flight")
        self.active, self.reduced, self.late, self.early = True, None, False, 0
        self._works, self._fired, self._next, self._late = [], set(), 0, False
        self._waiting = [len(b) for b in self.buckets]
        self._stack = contextlib.ExitStack()
        self._keep = self._stack.enter_context(settled())
        return self._arm

    def _arm(self) -> None:
        if self._hooks or not self.active:
            return
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _on_grad(self, p: torch.Tensor) -> None:
        """``p``'s gradient is final for the step (it is accumulated in the last backward)."""
        key = id(p)
        if key in self._fired:  # a second accumulation in one backward: its bucket may have gone already
            self._late = True
            return
        self._fired.add(key)
        self._waiting[self.where[key]] -= 1
        while self._next < len(self.buckets) and self._waiting[self._next] == 0:  # strictly in order
            self._launch(self._next, copy=True)
            self.early += 1

    def _launch(self, index: int, *, copy: bool) -> None:
        assert self.flats is not None and self._keep is not None
        flat = self.flats[index]
        start = 0
        for p in self.buckets[index]:
            part = flat[start:start + p.numel()].view_as(p)
            start += p.numel()
            if copy and p.grad is not None:
                part.copy_(p.grad)  # into the buffer: the gradient itself stays this rank's own sum
            else:
                part.zero_()
        self._works.append(dist.all_reduce(self._keep(flat), group=self.group, async_op=True))
        self._next = index + 1  # counted once issued: a failure before it leaves it to finish()

    def finish(self, status: int, scalars: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None]:
        """After the micro-batches, on every rank, whatever they did: the buckets not sent yet (in
        order), every bucket's work waited on, then the flag exchange (with which gradients exist,
        whether one was late, and the step's ``scalars`` where given: one exchange instead of a
        second one after the gradients), so that no gradient collective is in flight when the flag
        is exchanged (DESIGN.md, Scale); then the buffers settled. Returns the agreed status (the
        worst over the ranks: OK=0 < OOM=1 < ERROR=2) and the scalars summed over the ranks (None
        where none were given). Every rank gives scalars of the same length, or none."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        try:
            ok = status == 0
            while self._next < len(self.buckets):
                self._launch(self._next, copy=ok)  # after a failure: zeros, only to keep the order
            for index in range(len(self._works)):
                self._works[index].wait()
            # one SUM in float64 (exact for the counts and the flags; the scalars are summed in float64
            # as sum_items does): status as two counts, then the late flag, the presence bits, the scalars
            flags = [status == 1, status == 2, self._late] + [p.grad is not None for p in self.params]
            # built where the exchange runs (gloo: the CPU, so MPS, which has no float64, is no case of its own)
            device = _comm_device(self.group)
            local = torch.tensor(flags, dtype=torch.float64, device=device)
            if scalars is not None:
                local = torch.cat([local, scalars.detach().reshape(-1).to(device, torch.float64)])
            summed = _all_reduce(local, dist.ReduceOp.SUM, self.group)
        finally:
            self._works = []  # a work handle holds its tensor: dropped before the settle below
            self._stack.close()  # returns once gloo's worker let go of every buffer (settle.py)
            self._keep, self.active = None, False
        count = 3 + len(self.params)
        flags = summed[:count].tolist()
        sums = summed[count:] if scalars is not None else None
        agreed = 2 if flags[1] > 0 else 1 if flags[0] > 0 else 0
        if agreed == 0:
            self.late = flags[2] > 0
            self.reduced = [f > 0 for f in flags[3:]]
            if self.late:
                self.disabled = ("a parameter's gradient was accumulated twice in one backward (e.g. a weight shared "
                                 "by two reentrant checkpointed regions)")
                warnings.warn(f"autoaccum: the gradient all-reduce is no longer overlapped with the last backward: "
                              f"{self.disabled}; this step's gradients were reduced after the backward instead",
                              stacklevel=user_stacklevel())
        return agreed, sums

    def copy_back(self) -> None:
        """The agreed sums into ``.grad``: a parameter some rank used gets the sum (a rank that did
        not use it gets it too), one no rank used keeps ``None``."""
        reduced, self.reduced = self.reduced, None
        assert reduced is not None and self.flats is not None
        used = dict(zip((id(p) for p in self.params), reduced))
        with torch.no_grad():
            for flat, bucket in zip(self.flats, self.buckets):
                start = 0
                for p in bucket:
                    summed = flat[start:start + p.numel()].view_as(p)
                    start += p.numel()
                    if not used[id(p)]:
                        continue
                    if p.grad is None:
                        p.grad = summed.clone()
                    else:
                        p.grad.copy_(summed)  # copy_ keeps the gradient's own dtype and layout
