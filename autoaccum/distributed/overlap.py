"""The gradient all-reduce overlapped with the last micro-batch's backward (DDP and plain modules),
and what keeps every rank's collectives in the same order whatever that micro-batch does.

gloo (and nccl) pair collectives by their order on the group: the k-th collective one rank issues
meets the k-th of every other rank. The guard's protocol keeps that order in both of its forms:

- **today's** (``autoaccum.distributed``): no gradient collective inside the accumulation window;
  the OOM flag, then the gradients, once every rank has said OK;
- **overlapped** (this module, where the guard found room for it): during the last micro-batch's
  backward each bucket of gradients but the last is all-reduced asynchronously as soon as every
  gradient in it is final (below), buckets strictly in their fixed order on
  every rank. After the micro-batches, whatever happened -- every backward done, or an OOM or error
  in any forward, loss or backward -- each rank issues the buckets it has not issued yet, in the
  same order (its local sums, or zeros after a failure), the last of them carrying the flag, and
  waits until every one is done. So every rank issues exactly ``buckets`` collectives after the
  cut's exchange (``autoaccum.cut_agreement``), of the same sizes in the same order: the flag can
  never meet a gradient all-reduce of another size, because it is part of the last one.

  **The flag in the last bucket.** After the last bucket's gradients comes a row: whether this
  rank ran out of memory (or failed), whether a bucket left before its gradients were final and
  whether a watched gradient was accumulated twice in the last backward (below), whether it
  proposes chaining the next step, which parameters have a gradient, and the
  step's loss sum and item count and, in a chained step, its row of the cut's exchange
  (``autoaccum.cut_agreement``), each rank's in a slot of its own (zeros in the others', so the SUM
  gathers them; every float64 and count written as three float32 pieces that add up to it exactly,
  :func:`_split`, and the scalars summed in float64 after the exchange). The flag is then known when the last bucket is: no exchange after
  the gradients (the hand-written loop has none either; on 2 gloo ranks a separate one waits for
  the slower rank to finish the last bucket: ``benchmarks/gloo_cost.py``, RESULTS.md). The last bucket is
  the first layers' gradients, final only at the very end of the backward, so sending it after
  the backward loses almost no overlap. Where the last bucket's dtype cannot hold the row exactly
  (bf16, fp16), the flag goes as before: one float64 all-reduce once every bucket is done.

  DESIGN.md's Scale section asks that the flag exchange happen only where no gradient collective
  can be in flight. That rule is kept literally where the flag has an exchange of its own; where it
  rides in the last bucket, earlier buckets may still be in flight while it goes. The hazard the
  rule prevents -- one rank's flag all-reduce pairing with another rank's gradient all-reduce of
  another size, and both processes dying -- cannot happen then: there is no flag collective apart
  from the gradients, and every rank's k-th collective is the same bucket. The randomized OOM
  injection (``tests/test_distributed_overlap.py``) runs this form (fp64 buckets), OOMs on one
  rank or both with buckets in flight: no hang, no mismatch, exact weights.

  Then gloo's worker has let go of every buffer (``settle``). If any rank said OOM (or ERROR),
  every rank drops the reduced sums -- its own gradients were never touched, the buffers are
  separate -- and the guard replays the step as today (same samples, same result; the replay is
  not overlapped). If every rank said OK, the sums become the gradients as views of the flat
  buffers (as DDP's ``gradient_as_bucket_view``: no copy back), until the next step clears them.

**How a bucket is known to be final.** A hook (post-accumulate-grad) on one parameter per bucket the
backward may send: at first the bucket's last, which a backward makes last where it makes gradients
in about the reverse of the parameters' order (the order DDP's buckets assume). The bucket leaves
once every watched parameter of it (and every earlier bucket) has its gradient for the step. What it
held is then recorded: each gradient tensor and its version counter. After the backward, a gradient
of a sent bucket that is another tensor now, or whose version moved (the backward added to it
later), shows that the bucket left before it was final: the flag tells every rank, the sums are
dropped and the step's gradients are reduced the old way (its local gradients are intact), and that
parameter is watched from then on (the order is learned; no warning: it is not a fault). A parameter
in a last bucket that carries the flag (sent after the backward) needs no hook; one never late
carries none (a hook costs about 3 us a parameter to register and remove and, once registered,
about 0.5 us in every later backward: ``benchmarks/host_costs.py``). A watched parameter whose
gradient changes after its hook fired -- accumulated twice in one backward (a weight shared across
two reentrant checkpointed regions), or written by a later hook -- cannot be watched at all: the step
is reduced the old way and overlap is switched off for this sync, with a warning (an unwatched one
is first learned, as above, then caught so on the next step). Not seen: a write to a sent gradient
that bypasses its version counter (``p.grad.data.mul_()`` in another parameter's hook, a numpy
alias); such a hook needs ``overlap="off"``. A watched parameter that gets no gradient in the last
micro-batch leaves its bucket waiting until after the backward (it is sent then, in order); an
unwatched one's gradient is final already; a parameter no rank used keeps ``grad=None``, as in one
process.
"""

from __future__ import annotations

import contextlib
import logging
import math
import struct
import warnings
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autoaccum.distributed.process_group import _all_reduce, _comm_device
from autoaccum.distributed.settle import settled
from autoaccum.log import user_stacklevel
from autoaccum.oom import is_oom
from autoaccum.sync import CUT_FIELDS, StepAgreement

__all__: list[str] = []  # internal: DistributedSync drives it

logger = logging.getLogger(__name__)

#: the step's scalars the flag carries (``autoaccum.accumulate.step_values``: the loss sum, the item
#: count, and which kind of loss each rank saw)
STEP_SCALARS = 4
#: the numbers each rank has in the row: its scalars, and its row of the cut's exchange (a chained
#: step's, ``autoaccum.cut_agreement``; zeros otherwise), in two regions (every rank's scalars first)
_SLOT = STEP_SCALARS + CUT_FIELDS
#: how many pieces of the last bucket's dtype hold one float64 exactly (float32: three, whose sum in
#: float64 is the value; float64: itself). Other dtypes (bf16, fp16) cannot hold the counts and sums
#: exactly: the flag then goes in an exchange of its own after the buckets.
_PIECES = {torch.float32: 3, torch.float64: 1}
#: up to this many ranks the flag's row is built and added up on the host in Python (a few dozen numbers a rank:
#: faster than tensor operations); beyond, with tensor operations (host work that does not grow with the ranks).
#: ``benchmarks/row_cost.py`` times both.
HOST_ROW_RANKS = 8
#: the counts at the row's start, before the presence bits: status (two: OOM, error), late, chain, twice
_COUNTS = 5
_TYPECODES = {torch.float32: "f", torch.float64: "d"}  # the row's dtypes as the array module names them
_FLOAT32 = struct.Struct("f")


class _OverlappedReduce:
    """Flat buffers for every bucket (kept from step to step), the hooks of one overlapped attempt,
    its work handles, and the sums waiting to be copied back after the ranks agreed."""

    def __init__(self, params: list[torch.nn.Parameter], buckets: list[list[torch.nn.Parameter]], group: Any) -> None:
        self.params, self.buckets, self.group = params, buckets, group
        self.ids = tuple(map(id, params))  # which parameters, in order: the sync builds a new one where they change
        self.where = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
        position = {id(p): i for i, p in enumerate(params)}
        self._positions = [[position[id(p)] for p in bucket] for bucket in buckets]  # each one's place in params
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        # the buckets' all-reduces go to the process group itself, as DDP's reducer sends them: the same call
        # with the same options that dist.all_reduce(async_op=True) makes, without its Python wrapper (issuing
        # one took 122 us this way against 173 us through it on 2 gloo ranks, benchmarks/gloo_cost.py), whose
        # checks hold for every bucket here: one dense tensor (a complex one is sent as its real view, as
        # there), a group this rank is in, no coalescing context
        self._pg = group if group is not None else dist.group.WORLD
        self._opts = _sum_options()
        #: the flag rides in the last bucket (its row after the gradients) where that bucket's dtype
        #: holds it exactly; else None: an exchange of its own after the buckets
        self.pieces = _PIECES.get(buckets[-1][0].dtype)
        self._flags = _COUNTS + len(params)  # status (2), late, chain, twice, presence: the row's counts
        self.row = 0 if self.pieces is None else self._flags + self.world_size * _SLOT * self.pieces
        #: the buckets the backward's hooks may send (all, or all but the last where it carries the flag)
        self._early_limit = len(buckets) - (self.pieces is not None)
        #: per bucket the backward may send, the parameters whose hooks say it is final: at first its
        #: last one (a backward makes gradients in about the reverse of the parameters' order, as DDP's
        #: buckets assume, so a bucket's last parameter is the last to be final), then also every one
        #: whose gradient changed after its bucket had left (:meth:`_late_params`). A parameter never
        #: late, or in a last bucket that carries the flag (sent after the backward), carries no hook.
        self.watched: list[list[torch.nn.Parameter]] = [[bucket[-1]] for bucket in buckets[:self._early_limit]]
        self.nbytes = sum(p.numel() * p.element_size() for p in params) + self.row * buckets[-1][0].element_size()
        self.flats: list[torch.Tensor] | None = None
        self._views: list[list[torch.Tensor]] = []  # each parameter's place in its bucket's flat buffer
        #: every bucket's gradients, flat (the last bucket without the flag's row); see :attr:`gradients`
        self.gradients: list[torch.Tensor] = []
        self._row_view: torch.Tensor | None = None  # the last bucket's room after its gradients: the flag's row
        self.disabled: str | None = None  # why overlap is off for good on this sync
        #: the last attempt agreed to chain the next step: every rank will send that step's buckets,
        #: so the buffers are kept until it starts (a release asked for meanwhile is declined)
        self.promised = False
        self.active = False  # between start() and finish()
        self.reduced: list[bool] | None = None  # after an agreed OK: which parameters have a sum to take
        self.late = False  # after an agreed OK: a gradient was late on some rank; reduce the old way
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
            last = len(self.buckets) - 1
            self.flats = [torch.empty(sum(p.numel() for p in b) + (self.row if i == last else 0),
                                      dtype=b[0].dtype, device=b[0].device)
                          for i, b in enumerate(self.buckets)]
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
        self.gradients = [flat[:flat.numel() - self.row] if i == last else flat for i, flat in enumerate(self.flats)]
        self._row_view = self.flats[-1][self.flats[-1].numel() - self.row:]  # sliced once: a view costs microseconds
        for flat, bucket in zip(self.flats, self.buckets):
            start, views = 0, []
            for p in bucket:
                views.append(flat[start:start + p.numel()].view_as(p))
                start += p.numel()
            self._views.append(views)
        return True

    def release(self, *, force: bool = False) -> None:
        """Give the buffers back (memory got tight): the next overlapped attempt allocates them again.
        Declined while a chained step is promised, unless ``force``: the guard forces it where every
        rank dropped the chain alike."""
        if not self.promised or force:
            self.flats, self._views, self.gradients, self._row_view, self.promised = None, [], [], None, False

    # -- one overlapped attempt ------------------------------------------------------------------------
    def start(self) -> Callable[[], None]:
        """Begin an attempt (every rank agreed to overlap it); returns ``arm``, to be called before the
        last micro-step's backward (the guard calls it when it hands out the last micro-batch)."""
        if self.flats is None or self.active:
            raise RuntimeError("internal: an overlapped attempt needs its buffers and no attempt in flight")
        self.active, self.reduced, self.late, self.early, self.promised = True, None, False, 0, False
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
        while self._next < self._early_limit and self._waiting[self._next] == 0:  # strictly in order
            self._launch(self._next, copy=True, during_backward=True)
            self.early += 1

    def _launch(self, index: int, *, copy: bool, during_backward: bool = False) -> None:
        assert self.flats is not None and self._keep is not None
        flat = self.flats[index]
        # into the buffer (one call for the bucket): the gradient itself stays this rank's own sum
        into, grads = [], []
        current = [p.grad for p in self.buckets[index]]
        if during_backward:  # what is sent, to tell after the backward whether any of it changed since (the
            # versions read before the copy: a change while it runs, from another device's thread, is seen)
            self._sent.append((index, current, [-1 if grad is None else grad._version for grad in current]))
        for grad, part in zip(current, self._views[index]):
            if copy and grad is not None:
                into.append(part)
                grads.append(grad)
            else:
                part.zero_()
        if into:
            torch._foreach_copy_(into, grads)
        if flat.is_complex():  # as dist.all_reduce sends it: the real and imaginary parts, summed alike
            flat = torch.view_as_real(flat)
        self._works.append(self._pg.allreduce([self._keep(flat)], self._opts))
        self._next = index + 1  # counted once issued: a failure before it leaves it to finish()

    def _late_params(self) -> list[torch.nn.Parameter]:
        """After the backward: the parameters of the buckets it sent whose gradient changed after its
        bucket left (another tensor, or the same one accumulated into: its version counter moved; the
        gradient it had then is held until here, so the comparison is by identity). Their bucket was
        not final when it left: an unwatched parameter's gradient was made after the watched ones'; a
        watched one's was accumulated twice or changed by a hook. A write that bypasses the version
        counter (``p.grad.data.mul_()`` on another parameter's gradient in a hook, a numpy alias) is
        not seen."""
        late = []
        for index, grads, versions in self._sent:
            for p, grad, version in zip(self.buckets[index], grads, versions):
                now = p.grad
                if now is not grad or (now is not None and now._version != version):
                    late.append(p)
        return late

    def finish(self, status: int, scalars: Sequence[float] | None = None, cut_row: tuple[int, ...] | None = None,
               chain_vote: bool = False) -> StepAgreement:
        """After the micro-batches, on every rank, whatever they did: the buckets not sent yet, in
        order, the flag (whether this rank failed, which gradients exist, whether one was late, its
        proposal to chain the next step, and the step's ``scalars`` and ``cut_row`` where given) in
        the last of them where its dtype holds it exactly, else in an exchange of its own once every
        bucket is done; every bucket waited on; then the buffers settled. Returns what the ranks
        agreed: the worst status (OK=0 < OOM=1 < ERROR=2), the scalars summed over the ranks
        (float64; None where none were given), whether every rank proposed to chain (and the step
        is OK), and every rank's cut row. Every rank gives scalars of the same length
        (:data:`STEP_SCALARS` where the flag rides in a bucket), or none."""
        try:
            ok = status == 0
            # a bucket sent before it was final: its sums are dropped on every rank (late), and an
            # unwatched parameter that changed is watched from now on. A watched one that changed (added
            # to again after its hook fired, or written by a later hook) cannot be watched: overlap goes
            # off (twice). After a failure the sums go anyway.
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
            # status as two counts, the late flag, the chain proposals, the watched gradient changed
            # after its hook, the presence bits: counts of ranks, exact in every dtype the flag is
            # exchanged in (float64, or a bucket's float32 up to 2**24 ranks)
            flags = [status == 1, status == 2, twice or bool(changed), chain_vote, twice] + \
                [p.grad is not None for p in self.params]
            if cut_row is not None and len(cut_row) != CUT_FIELDS:
                raise RuntimeError(f"internal: a cut row has {CUT_FIELDS} numbers, not {len(cut_row)}")
            if self.pieces is not None:
                self._write_row(flags, scalars, cut_row)
            while self._next < len(self.buckets):
                self._launch(self._next, copy=ok)  # after a failure: zeros, only to keep the order
            self._wait_all()
            if self.pieces is not None:
                counts, sums, rows = self._read_row(scalars is not None, cut_row is not None)
            else:
                counts, sums, rows = self._exchange_flag(flags, scalars, cut_row)
        finally:
            # the hooks go once the buckets are on their way (no backward is running now), or on any error
            for handle in self._hooks:
                handle.remove()
            self._hooks, self._sent = [], []
            self._works = []  # a work handle holds its tensor: dropped before the settle below
            settle, self._settle = self._settle, None
            if settle is not None:
                settle.__exit__(None, None, None)  # returns once gloo's worker let go of every buffer (settle.py)
            self._keep, self.active = None, False
        agreed = 2 if counts[1] > 0 else 1 if counts[0] > 0 else 0
        late = False
        if agreed == 0:
            self.late = late = counts[2] > 0
            self.reduced = [f > 0 for f in counts[_COUNTS:]]
            if counts[4] > 0:
                self.disabled = ("a watched parameter's gradient changed after its hook fired: it was accumulated twice "
                                 "in one backward (e.g. a weight shared by two reentrant checkpointed regions) or "
                                 "written by a later hook")
                warnings.warn(f"autoaccum: the gradient all-reduce is no longer overlapped with the last backward: "
                              f"{self.disabled}; this step's gradients were reduced after the backward instead",
                              stacklevel=user_stacklevel())
        chain = agreed == 0 and not late and counts[3] == self.world_size
        self.promised = chain
        return StepAgreement(agreed, sums, chain, rows)

    def _exchange_flag(self, flags: list[bool], scalars: Sequence[float] | None,
                       cut_row: tuple[int, ...] | None) -> tuple[list[float], tuple[float, ...] | None,
                                                                 tuple[tuple[int, ...], ...]]:
        """The flag in an exchange of its own (the last bucket's dtype cannot hold it exactly): no
        gradient collective is in flight now (DESIGN.md, Scale). One SUM in float64 -- exact for the
        counts and the cut rows (each rank's in its own row of a matrix, zeros elsewhere); the
        scalars summed in float64 as sum_items does -- built where the exchange runs (gloo: the CPU,
        so MPS, which has no float64, is no case of its own)."""
        device = _comm_device(self.group)
        rows = torch.zeros(self.world_size, CUT_FIELDS, dtype=torch.float64, device=device)
        if cut_row is not None:
            rows[self.rank] = torch.tensor(cut_row, dtype=torch.float64)
        parts = [torch.tensor(flags, dtype=torch.float64, device=device)]
        if scalars is not None:
            parts.append(torch.tensor(list(scalars), dtype=torch.float64, device=device))
        parts.append(rows.reshape(-1))
        summed = _all_reduce(torch.cat(parts), dist.ReduceOp.SUM, self.group)
        count = len(flags)
        sums = tuple(summed[count:count + len(scalars)].tolist()) if scalars is not None else None
        gathered = summed[summed.numel() - rows.numel():].reshape(self.world_size, CUT_FIELDS).tolist()
        return summed[:count].tolist(), sums, tuple(tuple(int(v) for v in r) for r in gathered)

    def _wait_all(self) -> None:
        for index in range(len(self._works)):  # no loop variable: a work handle holds its tensor (settle)
            self._works[index].wait()

    # -- the flag in the last bucket -------------------------------------------------------------------
    def _tail(self) -> torch.Tensor:
        """The last bucket's room after its gradients: the flag's row."""
        assert self._row_view is not None
        return self._row_view

    def _write_row(self, flags: list[bool], scalars: Sequence[float] | None, cut_row: tuple[int, ...] | None) -> None:
        """This rank's row: the flags (summed over the ranks: counts), then one slot per rank for its
        scalars, then one per rank for its cut row, each number (a float64, or an integer below
        2**53) as :attr:`pieces` numbers of the bucket's dtype that add up to it exactly
        (:func:`_split`). Every other rank's slots hold zeros here, so the sum gathers every rank's
        slots unchanged; the scalars are added up in float64 after the exchange (:meth:`_read_row`).
        Up to :data:`HOST_ROW_RANKS` ranks the whole row is built on the host and copied in once;
        beyond, the row is zeroed and this rank's numbers (a handful) go to their three places, so
        that the host's work does not grow with the number of ranks."""
        assert self.pieces is not None
        if scalars is not None:
            values = list(scalars)
            if len(values) != STEP_SCALARS:
                raise RuntimeError(f"internal: the overlapped flag carries {STEP_SCALARS} scalars, not {len(values)}")
        else:
            values = [0.0] * STEP_SCALARS
        own = _split(values + [float(v) for v in (cut_row if cut_row is not None else (0,) * CUT_FIELDS)],
                     self.pieces)
        count, width = len(flags), STEP_SCALARS * self.pieces
        scalars_at = self._flags + self.rank * width
        cut_at = self._rows_at() + self.rank * CUT_FIELDS * self.pieces
        tail = self._tail()
        if self.world_size <= HOST_ROW_RANKS:
            row = [0.0] * self.row
            row[:count] = [float(f) for f in flags]
            row[scalars_at:scalars_at + width] = own[:width]
            row[cut_at:cut_at + CUT_FIELDS * self.pieces] = own[width:]
            tail.copy_(torch.frombuffer(array(_TYPECODES[tail.dtype], row), dtype=tail.dtype))  # no copy until here
            return
        tail.zero_()
        own_numbers = torch.tensor([float(f) for f in flags] + own, dtype=tail.dtype, device=tail.device)
        # three slices, no index tensor kept: the row adds no memory beyond the buffers' own
        tail[:count].copy_(own_numbers[:count])
        tail[scalars_at:scalars_at + width].copy_(own_numbers[count:count + width])
        tail[cut_at:cut_at + CUT_FIELDS * self.pieces].copy_(own_numbers[count + width:])

    def _rows_at(self) -> int:
        """Where the cut rows start in the row: after the flags and every rank's scalars."""
        assert self.pieces is not None
        return self._flags + self.world_size * STEP_SCALARS * self.pieces

    def _read_row(self, with_scalars: bool,
                  with_rows: bool) -> tuple[list[float], tuple[float, ...] | None, tuple[tuple[int, ...], ...]]:
        """The summed row: the flags' counts, the scalars summed over the ranks (float64; the same on
        every rank), and every rank's cut row where one was sent (a chained step; zeros otherwise).
        Each number's pieces are added largest first (every addition exact, :func:`_split`), then the
        ranks' numbers in rank order (a running sum: no reduction order of a kernel's choosing), in
        float64. Up to :data:`HOST_ROW_RANKS` ranks the row is read to the host as a list and added
        up in Python (a few dozen numbers: faster than launching tensor operations); beyond, read
        once in float64 and added up with tensor operations, the same additions in the same order,
        so that the host's Python work does not grow with the number of ranks."""
        assert self.pieces is not None
        if self.world_size <= HOST_ROW_RANKS:
            return self._read_row_on_host(with_scalars, with_rows)
        count, rows_at, pieces = self._flags, self._rows_at(), self.pieces
        row = self._tail().to(device="cpu", dtype=torch.float64)  # the one read
        sums = None
        if with_scalars:
            slots = row[count:rows_at].view(self.world_size, STEP_SCALARS, pieces)
            each = slots[..., 0]
            for k in range(1, pieces):
                each = each + slots[..., k]
            sums = tuple(each.cumsum(dim=0)[-1].tolist())  # rank by rank, as a loop would: the same bits everywhere
        if with_rows:
            gathered = row[rows_at:].view(self.world_size, CUT_FIELDS, pieces).sum(dim=2).round().to(torch.int64)
            rows = tuple(tuple(r) for r in gathered.tolist())
        else:
            rows = ((0,) * CUT_FIELDS,) * self.world_size
        return row[:count].tolist(), sums, rows

    def _read_row_on_host(self, with_scalars: bool,
                          with_rows: bool) -> tuple[list[float], tuple[float, ...] | None, tuple[tuple[int, ...], ...]]:
        """:meth:`_read_row` for a few ranks: one ``.tolist()``, the same float64 additions in Python."""
        assert self.pieces is not None
        count, rows_at, pieces = self._flags, self._rows_at(), self.pieces
        row = self._tail().tolist()  # the one read (float32 pieces are exact in a Python float)
        sums = None
        if with_scalars:
            numbers = _joined(row[count:rows_at], pieces)
            total = numbers[:STEP_SCALARS]
            for at in range(STEP_SCALARS, len(numbers), STEP_SCALARS):  # rank by rank
                total = [t + v for t, v in zip(total, numbers[at:at + STEP_SCALARS])]
            sums = tuple(total)
        if with_rows:
            numbers = [int(round(v)) for v in _joined(row[rows_at:], pieces)]
            rows = tuple(tuple(numbers[at:at + CUT_FIELDS]) for at in range(0, len(numbers), CUT_FIELDS))
        else:
            rows = ((0,) * CUT_FIELDS,) * self.world_size
        return row[:count], sums, rows

    def copy_back(self) -> None:
        """The agreed sums into ``.grad``: a parameter some rank used gets the sum (a rank that did
        not use it gets it too), one no rank used keeps ``None``. The sum is handed over as a view of
        the flat buffer, as DDP's ``gradient_as_bucket_view`` does (no copy; the step's own gradient
        is freed here): it stays the parameter's ``.grad`` until the next step clears the gradients
        (the guard sets them to None before accumulating). A gradient whose strides differ from a
        flat view's (e.g. channels_last) gets the sum copied into it instead."""
        reduced, self.reduced = self.reduced, None
        assert reduced is not None and self.flats is not None
        with torch.no_grad():
            for bucket, views, positions in zip(self.buckets, self._views, self._positions):
                for p, summed, at in zip(bucket, views, positions):
                    if not reduced[at]:
                        continue
                    if p.grad is not None and p.grad.stride() != summed.stride():
                        p.grad.copy_(summed)  # copy_ keeps the gradient's own layout
                    else:
                        p.grad = summed


def _sum_options() -> Any:
    """Options for an asynchronous SUM all-reduce, as ``dist.all_reduce(..., async_op=True)`` makes them."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    if hasattr(opts, "asyncOp"):  # newer torch: the caller waits on the handle (NCCL's stream use follows it)
        opts.asyncOp = True
    return opts


def _pieces(value: float, pieces: int) -> list[float]:
    """One value as :func:`_split` splits it, one piece at a time (``struct``'s float32 rounding, the
    same as a cast): the reference the tests hold :func:`_split` to, and ``benchmarks/row_cost.py``'s
    per-element row."""
    if pieces == 1:
        return [value]
    out = []
    for _ in range(pieces):
        piece = _float32(value)
        out.append(piece)
        value = value - piece if math.isfinite(piece) else 0.0
    return out


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (to nearest, ties to even, as a cast), as a Python float."""
    if not math.isfinite(value):
        return value
    try:
        return _FLOAT32.unpack(_FLOAT32.pack(value))[0]
    except OverflowError:  # beyond float32's range: a cast gives inf
        return math.copysign(math.inf, value)


def _split(values: list[float], pieces: int) -> list[float]:
    """Each of ``values`` (float64s) as ``pieces`` float32 numbers, value by value, whose sum, taken
    in float64 from the largest, is the value exactly (``pieces`` 1: the values themselves, for a
    float64 row): the value rounded to float32 (a C cast, as ``array('f')`` does: to nearest, ties to
    even; beyond float32's range, inf), then what rounding left out, rounded, then the rest (53 bits
    in three pieces of 24; each difference is exact in float64). Exact from 2**-77 in magnitude up to
    float32's largest (and for 0); closer to 0, within 2**-149 (float32's smallest step). A value
    beyond float32's range, inf or NaN keeps its first piece only (inf or NaN after the exchange:
    still not finite)."""
    if pieces == 1:
        return list(values)
    parts, rest = [], values
    for _ in range(pieces):
        rounded = array("f", rest).tolist()
        parts.append(rounded)
        if math.isfinite(sum(rounded)):  # float32 values: their float64 sum cannot overflow, so it is finite
            rest = [v - p for v, p in zip(rest, rounded)]  # exactly where every piece is (one check, not one each)
        else:
            rest = [v - p if math.isfinite(p) else 0.0 for v, p in zip(rest, rounded)]
    return [piece for number in zip(*parts) for piece in number]


def _joined(pieces_row: list[float], pieces: int) -> list[float]:
    """The numbers :func:`_split` wrote, from their pieces (largest first, in float64)."""
    if pieces == 1:
        return pieces_row
    numbers = pieces_row[0::pieces]
    for k in range(1, pieces):
        numbers = [n + p for n, p in zip(numbers, pieces_row[k::pieces])]
    return numbers
