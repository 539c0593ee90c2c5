"""The sync the guard uses under ``torch.distributed`` (``DistributedSync``), and the bucketed
gradient all-reduce for DDP and plain modules. The protocol -- where the ranks talk and why no
gradient collective runs inside the accumulation window -- is described in the package docstring
(``autoaccum.distributed``); FSDP2's side of the window is in ``autoaccum.distributed.fsdp2``."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from autoaccum.distributed.fsdp2 import _FSDP2Window
from autoaccum.distributed.models import ModelKind, model_kind
from autoaccum.distributed.process_group import _all_reduce, broadcast_plan, is_distributed
from autoaccum.distributed.settle import settled
from autoaccum.log import user_stacklevel
from autoaccum.plan.plan import Plan
from autoaccum.validate import check_positive_int

__all__ = ["BUCKET_BYTES", "DistributedSync"]

#: gradients are all-reduced in flat buckets of at most this many bytes (DDP's default bucket_cap_mb)
BUCKET_BYTES = 25 * 2**20



def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> Iterator[list[torch.nn.Parameter]]:
    """Consecutive runs of parameters of one dtype and device, each up to ``bucket_bytes`` (or one
    parameter): the flat buffer after the backward is never larger than that."""
    bucket: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if bucket and (p.dtype != bucket[0].dtype or p.device != bucket[0].device or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        yield bucket


class DistributedSync:
    """How the guard's ranks agree under ``torch.distributed``; see the package docstring for the protocol.

    Example (your own loop, under torchrun)::

        autoaccum.distributed.init_from_env()
        model = autoaccum.distributed.wrap_model(model, device)
        sync = autoaccum.distributed.DistributedSync(model)
        guard = autoaccum.OOMGuard(model, optimizer, target_batch=256, micro_batch=32, sync=sync)
        for rb in GlobalBatches(data, 256, rank=sync.rank, world_size=sync.world_size).epoch(0):
            guard.step(rb.batch, loss_fn, partial=rb.partial)

    Args:
        model: the model the guard trains: DDP-wrapped, FSDP2-sharded, or plain (then its parameters
            and buffers are broadcast from rank 0 here).
        group: the data-parallel process group (default: the whole world).
        bucket_bytes: size of the flat buffers gradients are all-reduced in (DDP and plain models).

    Raises:
        RuntimeError: no process group is initialised.
        TypeError: an FSDP1 model, or sparse embeddings.
    """

    def __init__(self, model: torch.nn.Module, *, group: Any = None, bucket_bytes: int = BUCKET_BYTES) -> None:
        if not is_distributed():
            raise RuntimeError("DistributedSync needs an initialised process group (torchrun + "
                               "autoaccum.distributed.init_from_env(), or torch.distributed.init_process_group)")
        check_positive_int(bucket_bytes, "bucket_bytes")
        self.model, self.group, self.bucket_bytes = model, group, bucket_bytes
        self.kind: ModelKind = model_kind(model)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._fsdp = _FSDP2Window(model) if self.kind == "fsdp2" else None
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        #: whether the model has buffers to broadcast after each step (as DDP, which lists its buffers when it is
        #: built; the same on every rank): a model without any skips walking its modules every step
        self._has_buffers = any(True for _ in model.buffers())
        sparse = [name for name, m in model.named_modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
        if sparse:  # checked here, the same on every rank, not when one rank meets a sparse gradient
            raise TypeError(f"sparse gradients ({', '.join(sparse[:3])}: sparse=True) are not supported by "
                            f"DistributedSync; use dense embeddings (sparse=False)")
        sync_bn = [name for name, m in model.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
        if sync_bn:
            warnings.warn(
                f"SyncBatchNorm ({', '.join(sync_bn[:3])}{'...' if len(sync_bn) > 3 else ''}) exchanges statistics "
                f"in every forward: a collective inside the accumulation window. An OOM on one rank in mid-forward "
                f"then leaves the others waiting in that collective until the process group's timeout. Use "
                f"BatchNorm/GroupNorm/LayerNorm for OOM recovery across ranks.", stacklevel=user_stacklevel())
        if self.kind == "plain":
            self._broadcast_from_rank_zero(list(model.parameters()) + list(model.buffers()))

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """The accumulation window: every micro-batch's forward and backward, with no collective inside."""
        if self.kind == "ddp":
            return self.model.no_sync()
        if self._fsdp is not None:
            return self._fsdp.window()
        return contextlib.nullcontext()

    def evaluation(self) -> contextlib.AbstractContextManager[None]:
        """Around one evaluation attempt (forwards without gradients), so that an OOM on one rank meets
        no collective on the way to ``agree``: FSDP2 unshards once at its start instead of in every
        module's forward. DDP runs no collective in a forward without gradients (it broadcasts buffers
        only before a forward that will sync gradients), a plain module none: nothing to do there."""
        if self._fsdp is not None:
            return self._fsdp.evaluation()
        return contextlib.nullcontext()

    def agree(self, status: int) -> int:
        """The worst status over all ranks (OK=0 < OOM=1 < ERROR=2)."""
        agreed = int(_all_reduce(torch.tensor([status], dtype=torch.int64), dist.ReduceOp.MAX, self.group).item())
        if agreed != 0 and self._fsdp is not None:
            # every rank replays from the same FSDP2 state, whether its own attempt failed or not,
            # so that every rank runs the same collectives (reshard now, gather again in the window)
            self._fsdp.dirty = True
        return agreed

    def agree_plan(self, plan: Plan) -> Plan:
        """One plan for every rank: the smallest micro-batch any rank proposes (``broadcast_plan``)."""
        return broadcast_plan(plan, self.group)

    def gather(self, values: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Every rank's ``values``, in rank order: one all-reduce (SUM) of a matrix holding ours in our row."""
        rows = torch.zeros(self.world_size, len(values), dtype=torch.int64)
        rows[self.rank] = torch.tensor(values, dtype=torch.int64)
        summed = _all_reduce(rows, dist.ReduceOp.SUM, self.group).tolist()
        return tuple(tuple(int(v) for v in row) for row in summed)

    def sum_items(self, count: torch.Tensor) -> torch.Tensor:
        """``count`` summed over ranks (same device and dtype as given)."""
        return _all_reduce(count, dist.ReduceOp.SUM, self.group)

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients over ranks, once per optimizer step, after every rank agreed the step is OK."""
        if self._fsdp is not None:
            self._fsdp.reduce(self.group)
            # parameters FSDP2 does not manage (e.g. owned by the loss and stepped by the optimizer)
            params = [p for p in params if id(p) not in self._fsdp.managed]
            if params:
                self._all_reduce_grads(params)
            return
        self._all_reduce_grads(params)
        if self._has_buffers and (self.kind == "plain" or getattr(self.model, "broadcast_buffers", False)):
            self._broadcast_from_rank_zero(list(self.model.buffers()))

    # -- DDP and plain modules ------------------------------------------------------------------------
    def _all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        # Which parameters have a gradient on some rank. A rank whose micro-batches never used a
        # parameter (or whose share of a partial last batch is empty) holds None: it adds zeros, so
        # that every rank runs the same collectives. A parameter no rank used stays None, as in one
        # process (and as DDP leaves it): an optimizer skips it, rather than decaying it on a zero.
        present = _all_reduce(torch.tensor([p.grad is not None for p in params], dtype=torch.int32),
                              dist.ReduceOp.MAX, self.group).tolist()
        live = [p for p, used in zip(params, present) if used]
        with settled() as keep:  # every bucket's tensor held until gloo's worker thread let go of it
            for bucket in _buckets(live, self.bucket_bytes):
                if len(bucket) == 1 and bucket[0].grad is not None and bucket[0].grad.is_contiguous():
                    dist.all_reduce(keep(bucket[0].grad), group=self.group)  # one big tensor: in place, no copy
                    continue
                flat = self._flat_buffer(bucket)
                offsets = [0]
                for p in bucket:
                    offsets.append(offsets[-1] + p.numel())
                for p, start, end in zip(bucket, offsets, offsets[1:]):
                    if p.grad is None:
                        flat[start:end].zero_()
                    else:
                        flat[start:end].copy_(p.grad.reshape(-1))
                dist.all_reduce(keep(flat[:offsets[-1]]), group=self.group)
                for p, start, end in zip(bucket, offsets, offsets[1:]):
                    summed = flat[start:end].view_as(p)
                    if p.grad is None:
                        p.grad = summed.clone()
                    else:
                        p.grad.copy_(summed)  # copy_ keeps the gradient's own dtype and layout

    def _flat_buffer(self, bucket: list[torch.nn.Parameter]) -> torch.Tensor:
        """A flat buffer kept from step to step (as DDP keeps its buckets): after the first step the
        reduction allocates no gradient-sized memory, so it does not run out of memory on one rank
        while the others wait in the all-reduce."""
        key = (bucket[0].dtype, bucket[0].device)
        numel = sum(p.numel() for p in bucket)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=key[0], device=key[1])
        return buffer

    def _broadcast_from_rank_zero(self, tensors: list[torch.Tensor]) -> None:
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad(), settled() as keep:
            for t in tensors:
                dist.broadcast(keep(t.data), src=src, group=self.group)
