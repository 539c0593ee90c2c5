"""Many processes: the guard and fit on ``torch.distributed`` (DDP or FSDP2), one process per device.

Where the ranks talk, per optimizer step, in the guard's order::

    step start    sum_items(n)          samples in the global batch              all_reduce SUM
    window        no_sync():            every micro-batch's forward + backward   no collective at all
    after it      agree(status)         OK < OOM < ERROR, the worst wins         all_reduce MAX
                  reduce_gradients()    gradients summed once                    all_reduce SUM (FSDP2:
                                                                                 reduce-scatter SUM)
                  sum_items(scalars)    loss sum, item (token) count             all_reduce SUM

The gloo hazard (a rank that runs out of memory inside a synchronising backward enters the flag
all-reduce while the other rank is inside its gradient all-reduce; the two collectives pair up and
both processes die) cannot happen here, because no micro-batch, not even the last, runs a
gradient collective: every forward and backward is inside the window, the OOM flag is exchanged
after it, and gradients are reduced once, after every rank has said OK. A rank that fails can only
be waiting in ``agree``, where every other rank is headed too.

- **DDP**: the window is ``model.no_sync()`` (forward included, so DDP neither prepares its reducer
  nor broadcasts buffers), gradients hold local sums, and :meth:`DistributedSync.reduce_gradients`
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
about), an OOM in clipping or ``optimizer.step()`` (the guard raises ``OptimizerStepOOMError`` on
that rank), and an error in your code between steps. There one rank stops while the others wait in
their next collective: under torchrun, the agent ends them when the first process exits; under a
launcher of your own, the process group's timeout does.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from autoaccum.plan import Plan
from autoaccum.validate import check_positive_int

__all__ = [
    "DistributedSync", "WorldInfo", "broadcast_plan", "full_state_dicts", "init_from_env", "is_distributed",
    "is_fsdp2", "is_rank_zero", "load_full_state_dicts", "model_kind", "unwrap_model",
    "world_info", "wrap_model",
]

logger = logging.getLogger(__name__)

ModelKind = Literal["ddp", "fsdp2", "plain"]
#: gradients are all-reduced in flat buckets of at most this many bytes (DDP's default bucket_cap_mb)
BUCKET_BYTES = 25 * 2**20
#: what torchrun sets for every worker
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class WorldInfo:
    """Where this process stands: rank, world size, local rank on its node, and the backend (None alone)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None


def is_distributed() -> bool:
    """A ``torch.distributed`` process group is initialised (by the user, torchrun code or :func:`init_from_env`)."""
    return dist.is_available() and dist.is_initialized()


def world_info(group: Any = None) -> WorldInfo:
    """Rank and world size from the process group; from torchrun's variables before one exists; else one process."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if is_distributed():
        return WorldInfo(dist.get_rank(group), dist.get_world_size(group), local_rank, str(dist.get_backend(group)))
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE")):
        return WorldInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, None)
    return WorldInfo(0, 1, 0, None)


def init_from_env(backend: str | None = None, timeout_s: float | None = None) -> bool:
    """Initialise the default process group from torchrun's environment, if it is set and no group exists.

    torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. The
    backend is ``nccl`` when CUDA is available (each process then uses ``cuda:LOCAL_RANK``), else
    ``gloo``. The group is left initialised afterwards; destroy it with
    ``torch.distributed.destroy_process_group()`` when done.

    Returns:
        True if this call initialised the group; False when one existed or the variables are not set.
    """
    if is_distributed() or not dist.is_available() or not all(k in os.environ for k in _TORCHRUN_ENV):
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, **kwargs)
    logger.info("initialised process group from torchrun's environment: backend %s, rank %d of %d",
                backend, dist.get_rank(), dist.get_world_size())
    return True


def is_rank_zero(group: Any = None) -> bool:
    """True in the process that logs, writes checkpoints and shows progress (rank 0, or the only one)."""
    return world_info(group).rank == 0


# -- models ------------------------------------------------------------------------------------------
def is_fsdp2(model: torch.nn.Module) -> bool:
    """``model`` or one of its submodules was sharded with FSDP2's ``fully_shard``."""
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _is_fsdp1(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def model_kind(model: torch.nn.Module) -> ModelKind:
    """How a model is data-parallel: DDP-wrapped, FSDP2-sharded, or a plain module.

    Raises:
        TypeError: FSDP1 (``FullyShardedDataParallel``), which autoaccum does not drive.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    if not dist.is_available():
        return "plain"
    if is_fsdp2(model):
        return "fsdp2"
    if _is_fsdp1(model):
        raise TypeError("FullyShardedDataParallel (FSDP1) is not supported; shard the model with FSDP2 "
                        "(torch.distributed.fsdp.fully_shard) or wrap it in DistributedDataParallel")
    return "plain"


def wrap_model(model: torch.nn.Module, device: torch.device | str | None = None, **ddp_kwargs: Any) -> torch.nn.Module:
    """``model`` on ``device``, wrapped in DDP; a model already DDP-wrapped or FSDP2-sharded comes back as it is.

    Args:
        model: the module to train.
        device: where it runs (``cuda:LOCAL_RANK`` under torchrun with CUDA); None keeps it where it is.
        ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``broadcast_buffers=False``).

    Raises:
        RuntimeError: no process group is initialised.
    """
    if model_kind(model) != "plain":
        return model  # never wrap twice
    if not is_distributed():
        raise RuntimeError("wrap_model needs an initialised process group: launch with torchrun and call "
                           "autoaccum.distributed.init_from_env() (or torch.distributed.init_process_group)")
    if device is not None:
        model = model.to(device)
    device = next(model.parameters()).device
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device])
    return torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP wrapper (an FSDP2 or plain module is its own)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and optimizer's complete state, as one process would hold it, for rank 0 to write.

    DDP and plain modules: the inner module's ``state_dict()`` and the optimizer's. FSDP2: the shards
    are gathered with ``torch.distributed.checkpoint.state_dict`` (full state, on the CPU); a
    collective, so every rank must call this, and only rank 0 gets the state (the others get empty
    dicts). Loading it back: :func:`load_full_state_dicts`.
    """
    if model_kind(model) != "fsdp2":
        return unwrap_model(model).state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                          optimizer_state: dict) -> None:
    """Load what :func:`full_state_dicts` returned (every rank gives the full state it read from the file)."""
    if model_kind(model) != "fsdp2":
        unwrap_model(model).load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    # strict=False: a parameter that never had a gradient has no optimizer state, in one process too
    # (fit compares the checkpoint's parameter names and shapes with the model's before loading)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True, strict=False))


# -- agreement ---------------------------------------------------------------------------------------
def _comm_device(group: Any = None) -> torch.device:
    """Where small exchange tensors must live for the group's backend (gloo: CPU, nccl: the current GPU)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "xccl" in backend:
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def _all_reduce(values: torch.Tensor, op: Any, group: Any = None) -> torch.Tensor:
    """``values`` reduced over the group with ``op``, returned on the device and in the dtype they came in."""
    device = _comm_device(group)
    work = values.detach().to(device, copy=True)
    dist.all_reduce(work, op=op, group=group)
    return work.to(values.device)


def broadcast_plan(plan: Plan | None, group: Any = None) -> Plan:
    """One plan for every rank: the smallest micro-batch any rank proposes.

    Rank 0 must give its plan (e.g. ``probe(...).plan``); the others give theirs (each rank may have
    probed its own device, and the smallest feasible micro-batch wins) or None to take rank 0's.

    Raises:
        ValueError: the ranks disagree on ``target_batch`` or ``world_size`` (raised on every rank).
    """
    if not is_distributed():
        if plan is None:
            raise ValueError("broadcast_plan needs a plan when there is no process group")
        return plan
    rank = dist.get_rank(group)
    if plan is None and rank == 0:
        raise ValueError("rank 0 must give broadcast_plan its plan; other ranks may give None")
    big = torch.iinfo(torch.int64).max
    if plan is None:
        values = [big, big, big, big, big]  # no opinion: MIN ignores it
    else:
        values = [plan.micro_batch, plan.target_batch, -plan.target_batch, plan.world_size, -plan.world_size]
    micro, target_min, neg_target_max, world_min, neg_world_max = _all_reduce(
        torch.tensor(values, dtype=torch.int64), dist.ReduceOp.MIN, group).tolist()
    if target_min != -neg_target_max or world_min != -neg_world_max:
        raise ValueError(f"the ranks' plans disagree: target_batch {target_min}..{-neg_target_max}, world_size "
                         f"{world_min}..{-neg_world_max}; every rank must plan the same target_batch and world_size")
    if plan is not None and plan.micro_batch == micro:
        return plan
    return Plan.for_target(int(target_min), int(micro), int(world_min))  # the smallest micro-batch wins


# -- the sync ----------------------------------------------------------------------------------------
def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> Iterator[list[torch.nn.Parameter]]:
    """Consecutive runs of parameters of one dtype and device, each up to ``bucket_bytes`` (or one parameter)."""
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
    """How the guard's ranks agree under ``torch.distributed``; see the module docstring for the protocol.

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
                f"BatchNorm/GroupNorm/LayerNorm for OOM recovery across ranks.", stacklevel=2)
        if self.kind == "plain":
            self._broadcast_from_rank_zero(list(model.parameters()) + list(model.buffers()))

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """The accumulation window: every micro-batch's forward and backward, with no collective inside."""
        if self.kind == "ddp":
            return self.model.no_sync()
        if self._fsdp is not None:
            return self._fsdp.window()
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
        """One plan for every rank: the smallest micro-batch any rank proposes (:func:`broadcast_plan`)."""
        return broadcast_plan(plan, self.group)

    def rank_sizes(self, num_samples: int) -> tuple[int, ...]:
        """Every rank's sample count, in rank order: one all-reduce of a vector with ours at our rank."""
        counts = torch.zeros(self.world_size, dtype=torch.int64)
        counts[self.rank] = num_samples
        return tuple(int(c) for c in _all_reduce(counts, dist.ReduceOp.SUM, self.group).tolist())

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
        if self.kind == "plain" or getattr(self.model, "broadcast_buffers", False):
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
        for bucket in _buckets(live, self.bucket_bytes):
            if len(bucket) == 1 and bucket[0].grad is not None and bucket[0].grad.is_contiguous():
                dist.all_reduce(bucket[0].grad, group=self.group)  # one big tensor: in place, no copy
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
            dist.all_reduce(flat[:offsets[-1]], group=self.group)
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
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t.data, src=src, group=self.group)


class _FSDP2Window:
    """FSDP2 without collectives inside the accumulation window (see the module docstring).

    Public FSDP2 calls do the configuration (``set_requires_gradient_sync``, ``unshard``, ``reshard``,
    ``reset_iter_state``, ``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms``,
    ``set_reduce_scatter_unused_params``). Three things have no public form in torch 2.13 and touch
    FSDP2's internals, here only: switching resharding off for the window and back (restoring each
    parameter group's own setting), clearing the unsharded gradients of a failed attempt, and running
    FSDP2's end-of-backward reduction (``_root_post_backward_final_callback``) once after the window.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.managed = {id(fp.sharded_param) for g in self._groups() for fp in g.fsdp_params}
        for name in ("reset_iter_state", "set_force_sum_reduction_for_comms", "set_reduce_scatter_unused_params"):
            if not hasattr(self.modules[0], name):
                raise RuntimeError(f"FSDP2 under autoaccum needs FSDPModule.{name} (torch >= 2.13); this is torch "
                                   f"{torch.__version__}. Upgrade torch, or wrap the model in DDP instead")
        # FSDP2 modules with no FSDP2 ancestor: the roots that own a backward's final reduction
        inner = {id(sub) for m in self.modules for sub in m.modules() if sub is not m}
        self.roots = [m for m in self.modules if id(m) not in inner]
        for m in self.modules:
            # The guard weights each micro-batch by its share of the global batch: SUM over ranks, no
            # division (gloo cannot run the PREMUL_SUM a divide factor uses); a parameter a rank did
            # not use adds zeros instead of leaving the ranks' reduce-scatters mismatched.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            m.set_reduce_scatter_unused_params(True, recurse=False)
        self.dirty = False  # a window ended by an exception: FSDP2's iteration state needs a reset
        self.saved: list[tuple[Any, Any, bool]] | None = None

    def _groups(self) -> list[Any]:
        return [g for m in self.modules for g in m._get_fsdp_state()._fsdp_param_groups]

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        if self.dirty:
            for root in self.roots:
                root.reset_iter_state()  # FSDP2's documented recovery after a forward/backward raised
            self.dirty = False
        for root in self.roots:
            root._get_fsdp_state()._lazy_init()  # what the first forward would do; unshard() needs it
            root.set_requires_gradient_sync(False)
        if self.saved is None:
            self.saved = [(g, g.post_forward_mesh_info, g.reshard_after_backward) for g in self._groups()]
        for g, _, _ in self.saved:
            g.post_forward_mesh_info = None  # no reshard after forward
            g.reshard_after_backward = False
        for m in self.modules:
            m.unshard()  # the window's only collective, before any user code runs
        for g, _, _ in self.saved:
            for fp in g.fsdp_params:  # what a failed attempt accumulated
                fp.unsharded_param.grad = None
                fp.unsharded_accumulated_grad = None
        yield

    def reduce(self, group: Any) -> None:
        # As for DDP: a parameter no rank used ends with no gradient (FSDP2 would reduce-scatter zeros).
        fsdp_params = [fp for g in self._groups() for fp in g.fsdp_params]
        local = [fp.unsharded_param.grad is not None or fp.unsharded_accumulated_grad is not None
                 for fp in fsdp_params]
        present = _all_reduce(torch.tensor(local, dtype=torch.int32), dist.ReduceOp.MAX, group).tolist()
        for root in self.roots:
            root.set_requires_gradient_sync(True)
            # Runs post_backward (reduce-scatter of the accumulated unsharded gradients) for every
            # parameter group, then waits for the reductions: FSDP2's own end of a backward.
            root._get_fsdp_state()._root_post_backward_final_callback()
        self._restore()
        for fp, used in zip(fsdp_params, present):
            if not used:
                fp.sharded_param.grad = None

    def _restore(self) -> None:
        if self.saved is not None:
            for g, post_forward, after_backward in self.saved:
                g.post_forward_mesh_info, g.reshard_after_backward = post_forward, after_backward
            self.saved = None
        for m in self.modules:
            m.reshard()
