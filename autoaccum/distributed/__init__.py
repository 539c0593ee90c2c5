"""Many processes: the guard and fit on ``torch.distributed`` (DDP or FSDP2), one process per device.

Where the ranks talk, per attempt of an optimizer step, in the guard's order::

    before        gather(row)           samples, micro-steps, items of a loss that   all_reduce SUM
                                        counts them up front, overlap votes, thrash  (waited for)
                                        (``autoaccum.step.sync``)
    window        no_sync():            every micro-batch's forward + backward       no collective at all
    after it      agree(status)         OK < OOM < ERROR, the worst wins             all_reduce MAX
                  reduce_gradients()    gradients summed once                        all_reduce SUM (FSDP2:
                                                                                     reduce-scatter SUM)
                  sum_items(scalars)    loss sum, item (token) count                 all_reduce SUM

The gloo hazard (a rank that runs out of memory inside a synchronising backward enters the flag
all-reduce while the other rank is inside its gradient all-reduce; the two collectives pair up and
both processes die) cannot happen in this protocol: no micro-batch, not even the last, runs a
gradient collective; the OOM flag is exchanged after the window, and gradients are reduced once,
after every rank has said OK. A rank that fails can only be waiting in ``agree``, where every other
rank is headed too.

``OOMGuard(overlap="on")`` (experimental, DDP and plain modules, ``autoaccum.distributed.overlap``)
all-reduces the buckets during the last micro-batch's backward instead; after it every rank sends
the buckets it has not sent (zeros after a failure), waits for all of them, and only then exchanges
the flag: every rank issues the same collectives in the same order whatever its micro-batches did.

- **DDP**: the window is ``model.no_sync()`` (forward included, so DDP neither prepares its reducer
  nor broadcasts buffers), gradients hold local sums, and ``DistributedSync.reduce_gradients``
  all-reduces them in flat buckets (SUM: the guard weights each micro-batch by its share of the
  *global* batch, so the sum over ranks is the full-batch gradient; DDP's own averaging never runs).
  Buffers (BatchNorm statistics) are then broadcast from rank 0, as DDP does before a forward.
- **A plain module** (not wrapped) is treated like DDP; its parameters and buffers are broadcast from
  rank 0 when the sync is built, so every rank starts equal.
- **FSDP2** (``fully_shard``) all-gathers parameters inside forward and backward, which would put
  collectives in the window. So at the window's start every FSDP module is unsharded once (one
  all-gather, before any user code), resharding after forward/backward is switched off for the
  window, gradients accumulate unsharded (as under FSDP2's own ``set_requires_gradient_sync(False)``),
  and after the flag exchange FSDP2 reduce-scatters them once (SUM) and reshards. Optimizer state
  stays sharded; during accumulation each rank holds the full parameters and gradients.

What is not agreed on: an OOM in the FSDP2 all-gather at the window's start (memory that does not
depend on the micro-batch), a collective the model runs in its own forward (SyncBatchNorm: warned
about; such a model also needs the same number of forwards on every rank), an OOM in clipping or
``optimizer.step()`` (the guard raises ``OptimizerStepOOMError`` on that rank), and an error in your
code between steps. There one rank stops while the others wait in their next collective: under
torchrun, the agent ends them when the first process exits; otherwise the process group's timeout
does (``init_from_env`` sets 5 minutes; on NCCL the watchdog then aborts the process).

The package, by job: ``process_group`` (where this process stands, torchrun's environment, the
small all-reduces, one plan for every rank), ``models`` (DDP, FSDP2 or plain; wrapping; full state
for checkpoints), ``ddp`` (``DistributedSync`` and the bucketed gradient all-reduce),
``overlap`` (the experimental all-reduce during the last backward), ``fsdp2`` (FSDP2's side of the
accumulation window), ``settle`` (every collective returns only once gloo's worker thread has let go
of its tensors, so nothing is freed on a worker thread during interpreter shutdown).
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
    "DEFAULT_TIMEOUT_S", "DistributedSync", "WorldInfo", "broadcast_plan", "full_state_dicts", "gather_to_rank_zero", "init_from_env",
    "is_distributed", "is_fsdp2", "is_rank_zero", "load_full_state_dicts", "model_kind", "settled", "unwrap_model",
    "world_info", "wrap_model",
]
