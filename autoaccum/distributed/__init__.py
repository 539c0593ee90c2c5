"""Many processes: the guard and ``fit`` on ``torch.distributed`` (DDP or FSDP2), one process per device.

Per attempt of an optimizer step the ranks talk at fixed points only, in the guard's order::

    before the window  gather(row)         samples, micro-steps, items, thrash                 all_reduce SUM
    the window         no_sync()           every micro-batch's forward + backward              none
    after the window   agree(status)       OK < OOM < ERROR, the worst wins                    all_reduce MAX
    after OK           reduce_gradients()  gradients summed once        all_reduce SUM (FSDP2: reduce-scatter)
                       sum_items(scalars)  loss sum, item (token) count                        all_reduce SUM

No micro-batch, not even the last, runs a gradient collective: under DDP the window is
``model.no_sync()`` (forward included); under FSDP2 every FSDP module is unsharded once at the
window's start and reduce-scatters once after the flag (``fsdp2``); a plain module is treated like
DDP, broadcast from rank 0 when the sync is built. So when the status is agreed no gradient
collective can be in flight: a rank that ran out of memory can only be waiting in ``agree``, where
every other rank is headed too, and an OOM on one rank becomes a shrink on every rank. Gradients are
summed, not averaged: each micro-batch is weighted by its share of the global batch.

Not agreed on: an OOM in FSDP2's all-gather at the window's start, a collective the model runs in its
own forward (SyncBatchNorm, warned about), an OOM in clipping or ``optimizer.step()``, an error in
the caller's code between steps. Then the other ranks wait in their next collective until torchrun's
agent ends them or the process group's timeout does (``init_from_env`` sets ``DEFAULT_TIMEOUT_S``,
300 s; on NCCL the watchdog then aborts the process).

The package, by job: ``process_group`` (where this process stands, torchrun's environment, the
small all-reduces, one plan for every rank), ``models`` (DDP, FSDP2 or plain; wrapping; full state
for checkpoints), ``ddp`` (``DistributedSync`` and the bucketed gradient all-reduce), ``fsdp2`` (FSDP2's side of the
window), ``settle`` (collectives that return only once gloo's worker thread has let go of their tensors).
"""

from __future__ import annotations

from autoaccum.distributed.ddp import BUCKET_BYTES, DistributedSync  # noqa: F401 - BUCKET_BYTES: a public constant
from autoaccum.distributed.models import (
    ModelKind,  # noqa: F401
    full_state_dicts,
    is_fsdp2,
    load_full_state_dicts,
    model_kind,
    unwrap_model,
    wrap_model,
)
from autoaccum.distributed.process_group import (
    DEFAULT_TIMEOUT_S,
    WorldInfo,
    broadcast_plan,
    gather_to_rank_zero,
    init_from_env,
    is_distributed,
    is_rank_zero,
    world_info,
)
from autoaccum.distributed.settle import settled

__all__ = [
    "DEFAULT_TIMEOUT_S", "DistributedSync", "WorldInfo", "broadcast_plan", "full_state_dicts", "gather_to_rank_zero",
    "init_from_env", "is_distributed", "is_fsdp2", "is_rank_zero", "load_full_state_dicts", "model_kind", "settled",
    "unwrap_model", "world_info", "wrap_model",
]
