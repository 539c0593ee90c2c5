"""How the ranks of a step agree: the local (one-process) case. The distributed one lives in
``autoaccum.distributed`` and has the same methods.

The guard asks these things of a sync, in this order, once per attempt of an optimizer step:

1. ``gather(row)``: every rank's row of the cut's exchange (``agree_cut``: its samples, the
   micro-steps its cut needs, its item count, whether its allocator thrashed),
   before any micro-batch runs;
2. ``no_sync()`` around every micro-batch's forward and backward: no gradient collective runs
   while a rank may still hit an OOM;
3. ``agree(status)``: the worst status over all ranks (OK < OOM < ERROR), where no gradient
   collective can be in flight, so an OOM on one rank becomes a shrink on every rank; after a
   shrink, ``agree_plan(plan)``: the smallest micro-batch any rank proposes;
4. ``reduce_gradients()`` and ``sum_items()``: gradients summed over ranks once, the step's scalars too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from autoaccum.errors import TaskError
from autoaccum.plan.plan import Plan

__all__ = ["agree_cut", "Agreed", "CutTerms", "ERROR", "GradSync", "LocalSync", "OK", "OOM"]

OK, OOM, ERROR = 0, 1, 2


class GradSync(Protocol):
    rank: int
    world_size: int

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...
    def agree(self, status: int) -> int: ...
    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None: ...
    def sum_items(self, count: torch.Tensor) -> torch.Tensor: ...
    def gather(self, values: tuple[int, ...]) -> tuple[tuple[int, ...], ...]: ...
    def agree_plan(self, plan: Plan) -> Plan: ...


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
    error: TaskError | None  # raised on every rank
    thrashing: tuple[int, ...] = ()  # the ranks whose allocator thrashed (every rank shrinks after the step)


def agree_cut(sync: GradSync, *, num_samples: int, steps: int, items: int | None,
              thrash: bool = False) -> Agreed:
    """One exchange of every rank's row; the answer.

    Args:
        num_samples: this rank's samples of the step.
        steps: the micro-steps this rank's cut needs (every rank runs the largest).
        items: this rank's item count up front (None: its loss counts none).
        thrash: this rank's allocator thrashed (the guard's streak reached ``thrash_steps``).
    """
    row = (num_samples, steps, items or 0, int(items is not None), int(thrash))
    return decide(sync.gather(row))


def decide(rows: tuple[tuple[int, ...], ...]) -> Agreed:
    """What every rank concludes from the rows (samples, micro-steps, items, counted, thrash)."""
    counted = sum(r[3] for r in rows)
    num_items = sum(r[2] for r in rows) if counted else None
    terms = CutTerms(sum(r[0] for r in rows), max(r[1] for r in rows), num_items)
    error = None
    if 0 < counted < len(rows):
        error = TaskError("loss_fn.count_items counted items on some ranks and not on others; give every "
                          "rank batches of the same kind")
    elif num_items == 0:
        error = TaskError("the step's batch holds no item its loss averages over (every label is -100); "
                          "nothing to train on")
    return Agreed(terms, error=error, thrashing=tuple(rank for rank, r in enumerate(rows) if r[4]))
