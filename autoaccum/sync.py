"""How the ranks of a step agree: the local (one-process) case. The distributed one lives in
``autoaccum.distributed`` and has the same methods.

The guard asks these things of a sync, in this order, once per optimizer step:
1. ``gather((n, steps, vote, items, counted, guessed samples, guessed steps, sat out, thrash))``:
   every rank's sample count of the step, the micro-steps its cut needs (the counts' sum is the
   global batch; the largest step count is what every rank runs), its vote to overlap the
   all-reduce (below), the items of a loss that counts them up front, its guess, whether it sat out
   a chained attempt, and whether its allocator thrashed (:data:`CUT_FIELDS` numbers). A rank that can tell the answer alone sends it with ``gather_async`` and reads it
   before the last micro-batch (``autoaccum.cut_agreement``);
2. ``no_sync()`` around every micro-batch's forward and backward: no gradient collective runs
   while a rank may still hit an OOM (except an overlapped attempt's own buckets, below);
3. ``agree(status)``: the worst status over all ranks (OK < OOM < ERROR), exchanged where no
   gradient collective can be in flight (or, overlapped, after every rank issued the same
   ones, in the same order), so an OOM on one rank becomes a shrink on every rank;
   after a shrink, ``agree_plan(plan)``: the smallest micro-batch any rank proposes;
4. ``reduce_gradients()`` and ``sum_items(n)``: gradients summed over ranks once, token counts too.

A sync that can overlap the gradient all-reduce with the last micro-batch's backward
(:class:`OverlapSync`: ``DistributedSync`` for DDP and plain modules) is asked, in step 1, whether
it has room (``overlap_bytes``, ``prepare_overlap``); the ranks vote in the same ``gather``; where
every rank voted for it, ``overlapped()`` starts the attempt, the guard arms it before the last
micro-step, and ``agree_step(status, scalars)`` sends what was not sent yet, in order, the flag and
the step's scalars (loss sum, item count) in the last bucket (or, for bf16/fp16 buckets, in one
all-reduce after them), and waits for all of it (``autoaccum.distributed.overlap``).

The same row carries each rank's proposal to *chain* the next step (``chain_vote``): where every
rank proposed it and the step ended OK, the next step skips step 1's exchange; each rank sends its
row of step 1 (``cut_row``) in that step's flag instead, and the guard decides afterwards whether
the step stands (``autoaccum.cut_agreement``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from autoaccum.plan import Plan

__all__ = ["CUT_FIELDS", "GradSync", "LocalSync", "OK", "OOM", "ERROR", "OverlapSync", "StepAgreement"]

OK, OOM, ERROR = 0, 1, 2
#: the numbers in one rank's row of the cut's exchange (``autoaccum.cut_agreement``)
CUT_FIELDS = 9


@dataclass(frozen=True)
class StepAgreement:
    """What an overlapped attempt's flag brought back, the same on every rank."""

    status: int  # the worst over the ranks (OK < OOM < ERROR)
    sums: tuple[float, ...] | None  # the step's scalars summed over the ranks (in float64), where given
    chain: bool  # every rank proposed chaining the next step, and this one ended OK
    cut_rows: tuple[tuple[int, ...], ...]  # every rank's row of the cut's exchange (zeros where none was given)


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
    def release_overlap(self, *, force: bool = False) -> None: ...
    def overlapped(self, params: list[torch.nn.Parameter]) -> Callable[[], None]: ...
    def agree_step(self, status: int, scalars: Sequence[float], *, cut_row: tuple[int, ...] | None = None,
                   chain_vote: bool = False) -> StepAgreement: ...
    def gradient_buffers(self) -> list[torch.Tensor] | None: ...


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
