"""How the ranks of a step agree: the local (one-process) case. The distributed one lives in
``autoaccum.distributed`` and has the same methods.

The guard asks these things of a sync, in this order, once per attempt of an optimizer step:

1. ``gather(row)``: every rank's row of the cut's exchange (``agree_cut``: its samples, the
   micro-steps its cut needs, its overlap vote, its item count, whether its allocator thrashed),
   before any micro-batch runs;
2. ``no_sync()`` around every micro-batch's forward and backward: no gradient collective runs
   while a rank may still hit an OOM;
3. ``agree(status)``: the worst status over all ranks (OK < OOM < ERROR), where no gradient
   collective can be in flight, so an OOM on one rank becomes a shrink on every rank; after a
   shrink, ``agree_plan(plan)``: the smallest micro-batch any rank proposes;
4. ``reduce_gradients()`` and ``sum_items()``: gradients summed over ranks once, the step's scalars too.

An ``OverlapSync`` (``DistributedSync`` on DDP and plain modules) can instead, where every rank
voted for it in step 1 (``OOMGuard(overlap="on")``, experimental), all-reduce the gradients during the
last micro-batch's backward: ``overlapped()`` starts the attempt and returns ``arm``, called before the
last micro-step, and ``agree_step(status, scalars)`` sends every bucket not sent yet, waits for all of
them, and only then exchanges the flag and the step's scalars (``autoaccum.distributed.overlap``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from autoaccum.errors import TaskError
from autoaccum.plan.plan import Plan

__all__ = ["agree_cut", "Agreed", "CutTerms", "ERROR", "GradSync", "LocalSync", "OK", "OOM", "OVERLAP_WARNING",
    "OverlapMode", "OverlapSync", "StepAgreement"]

OK, OOM, ERROR = 0, 1, 2
#: whether the gradient all-reduce may run during the last micro-batch's backward (``OOMGuard(overlap=...)``)
OverlapMode = Literal["off", "on"]
#: said once when ``overlap="on"`` takes effect (a sync that can overlap: ``DistributedSync`` on DDP or a plain module)
OVERLAP_WARNING = (
    "autoaccum: overlap='on' is experimental: the gradient all-reduce runs during the last micro-batch's "
    "backward. It has been verified on gloo (CPU, 1-4 ranks) and on NCCL in a world of one, not on NCCL "
    "across GPUs; overlap='off' (the default) is the protocol proven there.")


@dataclass(frozen=True)
class StepAgreement:
    """What an overlapped attempt's flag brought back, the same on every rank."""

    status: int  # the worst over the ranks (OK < OOM < ERROR)
    sums: tuple[float, ...] | None  # the step's scalars summed over the ranks (in float64)


class GradSync(Protocol):
    rank: int
    world_size: int

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...
    def agree(self, status: int) -> int: ...
    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None: ...
    def sum_items(self, count: torch.Tensor) -> torch.Tensor: ...
    def gather(self, values: tuple[int, ...]) -> tuple[tuple[int, ...], ...]: ...
    def agree_plan(self, plan: Plan) -> Plan: ...


@runtime_checkable
class OverlapSync(Protocol):
    """A sync that can all-reduce gradients during the last micro-batch's backward."""

    def overlap_bytes(self, params: list[torch.nn.Parameter]) -> int | None: ...
    def prepare_overlap(self, params: list[torch.nn.Parameter]) -> bool: ...
    def release_overlap(self) -> None: ...
    def overlapped(self, params: list[torch.nn.Parameter]) -> Callable[[], None]: ...
    def agree_step(self, status: int, scalars: Sequence[float]) -> StepAgreement: ...


class LocalSync:
    """One process: nothing to exchange."""

    rank = 0
    world_size = 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def agree(self, status: int) -> int:
        return status

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        return None

    def sum_items(self, count: torch.Tensor) -> torch.Tensor:
        return count

    def gather(self, values: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        return (tuple(values),)

    def agree_plan(self, plan: Plan) -> Plan:
        return plan




@dataclass(frozen=True)
class CutTerms:
    """What an attempt's micro-batches run with."""

    num_samples: int  # samples of the global batch over all ranks
    steps: int  # micro-steps every rank runs
    num_items: int | None  # items of a loss that counts them up front, over all ranks


@dataclass(frozen=True)
class Agreed:
    """The exchange's answer, the same on every rank."""

    terms: CutTerms
    overlap: bool  # every rank voted to overlap (and there is no error)
    error: TaskError | None  # raised on every rank
    thrashing: tuple[int, ...] = ()  # the ranks whose allocator thrashed (every rank shrinks after the step)


def agree_cut(sync: GradSync, *, num_samples: int, steps: int, vote: bool, items: int | None,
              thrash: bool = False) -> Agreed:
    """One exchange of every rank's row; the answer.

    Args:
        num_samples: this rank's samples of the step.
        steps: the micro-steps this rank's cut needs (every rank runs the largest).
        vote: this rank votes to overlap the attempt's all-reduce.
        items: this rank's item count up front (None: its loss counts none).
        thrash: this rank's allocator thrashed (the guard's streak reached ``thrash_steps``).
    """
    row = (num_samples, steps, int(vote), items or 0, int(items is not None), int(thrash))
    return decide(sync.gather(row))


def decide(rows: tuple[tuple[int, ...], ...]) -> Agreed:
    """What every rank concludes from the rows (samples, micro-steps, vote, items, counted, thrash)."""
    counted = sum(r[4] for r in rows)
    num_items = sum(r[3] for r in rows) if counted else None
    terms = CutTerms(sum(r[0] for r in rows), max(r[1] for r in rows), num_items)
    error = None
    if 0 < counted < len(rows):
        error = TaskError("loss_fn.count_items counted items on some ranks and not on others; give every "
                          "rank batches of the same kind")
    elif num_items == 0:
        error = TaskError("the step's batch holds no item its loss averages over (every label is -100); "
                          "nothing to train on")
    return Agreed(terms, overlap=all(r[2] for r in rows) and error is None, error=error,
                  thrashing=tuple(rank for rank, r in enumerate(rows) if r[5]))
