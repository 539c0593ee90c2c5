"""The process group: where this process stands, torchrun's environment, and the small exchanges
(an all-reduce of a few integers, one plan for every rank) that need no model."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autoaccum.distributed.settle import settled
from autoaccum.memory.savers import saver_code, saver_from_code
from autoaccum.plan.plan import Plan

if dist.is_available():
    # Imported before any process group exists, on purpose: torch.distributed.nn.functional's
    # collectives take ``group=group.WORLD`` as a default argument, evaluated at import. Imported
    # after init_process_group (DDP's constructor does it, through torch._dynamo), those defaults
    # hold the default group for good, so destroy_process_group() cannot free it: gloo's worker
    # threads then live into interpreter shutdown, where a late one aborts the process.
    import torch.distributed.nn  # noqa: F401

__all__ = ["DEFAULT_TIMEOUT_S", "WorldInfo", "broadcast_plan", "gather_to_rank_zero", "init_from_env", "is_distributed",
           "is_rank_zero", "world_info"]

logger = logging.getLogger(__name__)

#: what torchrun sets for every worker
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: how long a collective waits for the other ranks, where ``init_from_env`` creates the group
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class WorldInfo:
    """Where this process stands: rank, world size, local rank on its node, and the backend (None alone)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None


def is_distributed() -> bool:
    """A ``torch.distributed`` process group is initialised (by the user, torchrun code or ``init_from_env``)."""
    return dist.is_available() and dist.is_initialized()


def world_info(group: Any = None) -> WorldInfo:
    """Rank and world size from the process group; from torchrun's variables before one exists; else one process."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if is_distributed():
        return WorldInfo(dist.get_rank(group), dist.get_world_size(group), local_rank, str(dist.get_backend(group)))
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE")):
        return WorldInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, None)
    return WorldInfo(0, 1, 0, None)


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Initialise the default process group from torchrun's environment, if it is set and no group exists.

    torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. The
    backend is ``nccl`` when CUDA is available (each process then uses ``cuda:LOCAL_RANK``), else
    ``gloo``. The group is left initialised afterwards; destroy it with
    ``torch.distributed.destroy_process_group()`` when done.

    Args:
        backend: ``nccl``, ``gloo``, ... (default: as above).
        timeout_s: how long a collective waits for the other ranks before it fails (default
            ``DEFAULT_TIMEOUT_S``, 300 s, instead of torch's 10 minutes for NCCL and 30 for gloo),
            so that a rank that hangs ends the others within it (gloo: the waiting call raises;
            NCCL: the watchdog aborts the process). Raise it where one rank legitimately works
            alone for longer (a long evaluation or checkpoint write on rank 0).

    Returns:
        True if this call initialised the group; False when one existed or the variables are not set.

    Raises:
        ValueError: ``timeout_s`` is not a positive number.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"Invalid timeout_s: {timeout_s!r}. Allowed range: > 0 seconds (default "
                         f"{DEFAULT_TIMEOUT_S:g}); raise it where one rank works alone for longer")
    if is_distributed() or not dist.is_available() or not all(k in os.environ for k in _TORCHRUN_ENV):
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("initialised process group from torchrun's environment: backend %s, rank %d of %d, collective "
                "timeout %g s", backend, dist.get_rank(), dist.get_world_size(), timeout_s)
    return True


def is_rank_zero(group: Any = None) -> bool:
    """True in the process that logs, writes checkpoints and shows progress (rank 0, or the only one)."""
    return world_info(group).rank == 0


# -- small exchanges ---------------------------------------------------------------------------------
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
    with settled(work):  # returns once gloo's worker thread has let go of `work` (``autoaccum.distributed.settle``)
        dist.all_reduce(work, op=op, group=group)
    return work.to(values.device)


def gather_to_rank_zero(obj: Any, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj`` (picklable), in rank order, on rank 0; None on the other ranks. A collective:
    every rank of the group calls it. Without a process group: ``[obj]``.

    Not ``dist.gather_object``: it runs its all-gather and gather on tensors it makes and drops inside
    the call, so gloo's worker thread may be the last to hold them and free them later, during
    interpreter shutdown (the exit-time abort, ``autoaccum.distributed.settle``). A trailing settled
    collective would not prove them gone either: gloo runs collectives on a pool of worker threads,
    and one thread finishing a later collective says nothing of another still letting go of an
    earlier one. So the same two steps run here on tensors this function holds until the worker let
    go of them: the pickled sizes (one settled all-reduce, each rank's size in its own slot), then
    one gather of the payloads padded to the largest size.
    """
    if not is_distributed() or dist.get_world_size(group) == 1:
        return [obj]
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = _comm_device(group)
    data = pickle.dumps(obj)  # unpickled below only on rank 0, from the group's own ranks
    slots = torch.zeros(world_size, dtype=torch.int64)
    slots[rank] = len(data)
    sizes = [int(n) for n in _all_reduce(slots, dist.ReduceOp.SUM, group).tolist()]
    payload = torch.zeros(max(sizes), dtype=torch.uint8)
    payload[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    payload = payload.to(device)
    outs = [torch.empty_like(payload) for _ in range(world_size)] if rank == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    with settled(payload, *(outs or [])):  # returns once gloo's worker thread has let go of every one of them
        dist.gather(payload, gather_list=outs, dst=dst, group=group)
    if outs is None:
        return None
    return [pickle.loads(out[:size].cpu().numpy().tobytes()) for out, size in zip(outs, sizes)]


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
        values = [big] * 7  # no opinion: MIN ignores it
    else:
        values = [plan.micro_batch, plan.target_batch, -plan.target_batch, plan.world_size, -plan.world_size,
                  -plan.min_micro_batch, -saver_code(plan.saver)]
    micro, target_min, neg_target_max, world_min, neg_world_max, neg_smallest, neg_saver = _all_reduce(
        torch.tensor(values, dtype=torch.int64), dist.ReduceOp.MIN, group).tolist()
    if target_min != -neg_target_max or world_min != -neg_world_max:
        raise ValueError(f"the ranks' plans disagree: target_batch {target_min}..{-neg_target_max}, world_size "
                         f"{world_min}..{-neg_world_max}; every rank must plan the same target_batch and world_size")
    smallest = -neg_smallest  # the largest of the ranks' smallest micro-batches: every rank can train at it
    saver = saver_from_code(-neg_saver)  # the highest saver any rank needs
    if plan is not None and (plan.micro_batch, plan.min_micro_batch, plan.saver) == (micro, smallest, saver):
        return plan
    # the smallest micro-batch wins (never below what every rank can train at), with the highest saver
    return Plan.for_target(int(target_min), max(int(micro), smallest), int(world_min), smallest).with_saver(saver)
