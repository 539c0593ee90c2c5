"""The gradient all-reduce overlapped with the last micro-batch's backward (``OOMGuard(overlap="on")``).

**Experimental**, and not run by the project on NCCL across GPUs. The default (``overlap="off"``)
reduces the gradients after every rank said OK, with no collective inside the accumulation window
(``autoaccum.distributed``).

gloo and NCCL pair collectives by their order on the group (the k-th collective of one rank meets
the k-th of every other), so an overlapped attempt issues the same collectives in the same order
whatever its last micro-batch does. During the last backward each bucket is all-reduced
asynchronously once its gradients are final, strictly in bucket order. After the micro-batches
(every backward done, or an OOM or error anywhere) each rank issues the buckets it has not issued
yet, in the same order (its local sums, or zeros after a failure), and waits for all of them. Only
then is the flag exchanged, in one float64 all-reduce of its own: OOM or error, a bucket that left
too early, which parameters have a gradient, and the step's scalars (loss sum, item count, kinds of
loss). If any rank said OOM or ERROR, every rank drops the sums (the gradients themselves were never
touched: the buffers are separate) and the guard replays the step, not overlapped; if all said OK,
the sums become the gradients as views of the flat buffers (as DDP's ``gradient_as_bucket_view``).
The buffers stay allocated from step to step; a replay after an OOM gives them back first.

A bucket is final once a post-accumulate-grad hook has fired on each of its watched parameters (at
first its last one: a backward makes gradients in about the reverse of the parameters' order, as
DDP's buckets assume) and every earlier bucket has left. What each bucket sent during the backward
held is recorded (each gradient tensor and its version counter); after the backward, a change shows
that it left too early: the flag tells every rank, the step's gradients are reduced the default way,
and that parameter is watched from then on. A watched parameter whose gradient changes after its
hook fired (accumulated twice in one backward, e.g. a weight shared by two reentrant checkpointed
regions, or written by a later hook) cannot be watched: overlap is switched off for this sync, with
a warning. A write that bypasses the version counter (``p.grad.data.mul_()`` in another parameter's
hook) is not seen; such a hook needs ``overlap="off"``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autoaccum.distributed.process_group import _all_reduce, _comm_device
from autoaccum.distributed.settle import settled
from autoaccum.log import user_stacklevel
from autoaccum.memory.oom import is_oom
from autoaccum.step.sync import OK, StepAgreement

__all__: list[str] = []  # internal: DistributedSync drives it

logger = logging.getLogger(__name__)

#: the step's scalars the flag carries (``autoaccum.step.accumulate.step_values``: the loss sum, the item
#: count, and which kind of loss each rank saw)
STEP_SCALARS = 4
#: the counts at the flag's start, before the presence bits: status (two: OOM, error), late, twice
_COUNTS = 4

class _OverlappedReduce:
    """Flat buffers for every bucket (kept from step to step), the hooks of one overlapped attempt,
    its work handles, and the sums waiting to be copied back after the ranks agreed."""

    def __init__(self, params: list[torch.nn.Parameter], buckets: list[list[torch.nn.Parameter]], group: Any) -> None:
        self.params, self.buckets, self.group = params, buckets, group
        self.ids = tuple(map(id, params))  # which parameters, in order: the sync builds a new one where they change
        self.where = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
        position = {id(p): i for i, p in enumerate(params)}
        self._positions = [[position[id(p)] for p in bucket] for bucket in buckets]  # each one's place in params
        #: per bucket, the parameters whose hooks say it is final: at first its last one, then also
        #: every one whose gradient changed after its bucket had left (``_late_params``)
        self.watched: list[list[torch.nn.Parameter]] = [[bucket[-1]] for bucket in buckets]
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        self.flats: list[torch.Tensor] | None = None
        self._views: list[list[torch.Tensor]] = []  # each parameter's place in its bucket's flat buffer
        self.disabled: str | None = None  # why overlap is off for good on this sync
        self.active = False  # between start() and finish()
        self.reduced: list[bool] | None = None  # after an agreed OK: which parameters have a sum to take
        self.late = False  # after an agreed OK: a gradient was late on some rank; reduce the default way
        self.early = 0  # buckets of the last attempt sent from inside its backward (the overlap itself)
        self._hooks: list[Any] = []
        self._settle: contextlib.AbstractContextManager[Callable[[torch.Tensor], torch.Tensor]] | None = None
        self._keep: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._works: list[Any] = []
        #: the buckets sent during the backward: index, each parameter's gradient then and its version
        self._sent: list[tuple[int, list[torch.Tensor | None], list[int]]] = []
        self._waiting: list[int] = []
        self._fired: set[int] = set()
        self._next = 0

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
        self._views = []
        for flat, bucket in zip(self.flats, self.buckets):
            start, views = 0, []
            for p in bucket:
                views.append(flat[start:start + p.numel()].view_as(p))
                start += p.numel()
            self._views.append(views)
        return True

    def release(self) -> None:
        """Give the buffers back: the next overlapped attempt allocates them again."""
        self.flats, self._views = None, []

    # -- one overlapped attempt ------------------------------------------------------------------------
    def start(self) -> Callable[[], None]:
        """Begin an attempt (every rank agreed to overlap it); returns ``arm``, to be called before the
        last micro-step's backward."""
        if self.flats is None or self.active:
            raise RuntimeError("internal: an overlapped attempt needs its buffers and no attempt in flight")
        self.active, self.reduced, self.late, self.early = True, None, False, 0
        self._works, self._sent, self._fired, self._next = [], [], set(), 0
        self._waiting = [len(watched) for watched in self.watched]
        self._settle = settled()
        self._keep = self._settle.__enter__()  # left in finish(), whatever happens there
        return self._arm

    def _arm(self) -> None:
        if self._hooks or not self.active:
            return
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for watched in self.watched
                       for p in watched]

    def _on_grad(self, p: torch.Tensor) -> None:
        """``p``'s gradient is final for the step (it is accumulated in the last backward)."""
        key = id(p)
        if key in self._fired:  # a second accumulation in one backward: counted once; if its bucket had left,
            return  # the gradient's version moved since, which finish() sees (_late_params)
        self._fired.add(key)
        self._waiting[self.where[key]] -= 1
        while self._next < len(self.buckets) and self._waiting[self._next] == 0:  # strictly in order
            self._launch(self._next, copy=True, during_backward=True)
            self.early += 1

    def _launch(self, index: int, *, copy: bool, during_backward: bool = False) -> None:
        if self.flats is None or self._keep is None:
            raise RuntimeError("internal: a bucket launched outside an overlapped attempt")
        flat = self.flats[index]
        current = [p.grad for p in self.buckets[index]]
        if during_backward:  # what is sent, to tell after the backward whether any of it changed since
            self._sent.append((index, current, [-1 if grad is None else grad._version for grad in current]))
        into, grads = [], []
        for grad, part in zip(current, self._views[index]):
            if copy and grad is not None:
                into.append(part)
                grads.append(grad)
            else:
                part.zero_()
        if into:
            torch._foreach_copy_(into, grads)  # the gradient itself stays this rank's own sum
        self._works.append(dist.all_reduce(self._keep(flat), group=self.group, async_op=True))
        self._next = index + 1  # counted once issued: a failure before it leaves it to finish()

    def _late_params(self) -> list[torch.nn.Parameter]:
        """After the backward: the parameters of the buckets it sent whose gradient changed after its
        bucket left (another tensor, or the same one accumulated into: its version counter moved)."""
        late = []
        for index, grads, versions in self._sent:
            for p, grad, version in zip(self.buckets[index], grads, versions):
                now = p.grad
                if now is not grad or (now is not None and now._version != version):
                    late.append(p)
        return late

    def finish(self, status: int, scalars: Sequence[float]) -> StepAgreement:
        """After the micro-batches, on every rank, whatever they did: the buckets not sent yet, in
        order; every bucket waited on and settled; then the flag in an exchange of its own. Returns
        the worst status over the ranks (OK=0 < OOM=1 < ERROR=2) and the ``scalars`` summed over them."""
        try:
            ok = status == OK
            # A bucket sent before it was final: its sums are dropped on every rank (late), and an
            # unwatched parameter that changed is watched from now on. A watched one that changed
            # (added to after its hook fired, or written by a later hook) cannot be watched: overlap
            # goes off (twice). After a failure the sums go anyway.
            changed = self._late_params() if ok else []
            twice = False
            for p in changed:
                watched = self.watched[self.where[id(p)]]
                if any(w is p for w in watched):
                    twice = True
                else:
                    watched.append(p)
            if changed:
                logger.debug("overlap: %d gradients changed after their bucket left", len(changed))
            while self._next < len(self.buckets):
                self._launch(self._next, copy=ok)  # after a failure: zeros, only to keep the order
            for index in range(len(self._works)):  # no loop variable: a work handle holds its tensor (settle)
                self._works[index].wait()
        finally:
            for handle in self._hooks:  # no backward is running now
                handle.remove()
            self._hooks, self._sent, self._works = [], [], []  # a work handle holds its tensor: dropped first
            settle, self._settle = self._settle, None
            if settle is not None:
                settle.__exit__(None, None, None)  # returns once gloo's worker let go of every buffer (see settle)
            self._keep, self.active = None, False
        flags = [status == 1, status == 2, twice or bool(changed), twice] + [p.grad is not None for p in self.params]
        counts, sums = self._exchange_flag(flags, scalars)
        agreed = 2 if counts[1] > 0 else 1 if counts[0] > 0 else 0
        if agreed == 0:
            self.late = counts[2] > 0
            self.reduced = [f > 0 for f in counts[_COUNTS:]]
            if counts[3] > 0:
                self.disabled = ("a watched parameter's gradient changed after its hook fired: it was accumulated twice "
                                 "in one backward (e.g. a weight shared by two reentrant checkpointed regions) or "
                                 "written by a later hook")
                warnings.warn(f"autoaccum: the gradient all-reduce is no longer overlapped with the last backward: "
                              f"{self.disabled}; this step's gradients were reduced after the backward instead",
                              stacklevel=user_stacklevel())
        return StepAgreement(agreed, sums)

    def _exchange_flag(self, flags: list[bool], scalars: Sequence[float]) -> tuple[list[float], tuple[float, ...]]:
        """One SUM in float64 of the flags (counts of ranks) and the scalars, where the exchange runs."""
        values = [float(f) for f in flags] + [float(v) for v in scalars]
        summed = _all_reduce(torch.tensor(values, dtype=torch.float64, device=_comm_device(self.group)),
                             dist.ReduceOp.SUM, self.group).tolist()
        return summed[:len(flags)], tuple(summed[len(flags):])

    def copy_back(self) -> None:
        """The agreed sums into ``.grad``: a parameter some rank used gets the sum (a rank that did
        not use it gets it too), one no rank used keeps ``None``. The sum is handed over as a view of
        the flat buffer (no copy); a gradient whose strides differ from a flat view's (e.g.
        channels_last) gets the sum copied into it instead."""
        reduced, self.reduced = self.reduced, None
        if reduced is None or self.flats is None:
            raise RuntimeError("internal: no agreed sums to copy back")
        with torch.no_grad():
            for bucket, views, positions in zip(self.buckets, self._views, self._positions):
                for p, summed, at in zip(bucket, views, positions):
                    if not reduced[at]:
                        continue
                    if p.grad is not None and p.grad.stride() != summed.stride():
                        p.grad.copy_(summed)  # copy_ keeps the gradient's own layout
                    else:
                        p.grad = summed
