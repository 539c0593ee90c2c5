"""Cutting one rank's share of a global batch into the micro-batches of one optimizer step.

A cutter is passed to the guard (and to the evaluation), not hard-wired: how a batch is cut --
by samples here, by tokens for variable-length data -- is a choice of the caller. Every cutter
keeps two rules:

- the micro-batches of a step hold exactly the rank's samples, each once;
- every rank runs the same number of micro-steps, computed from the sizes of *all* ranks' shares
  (ranks that run different numbers of micro-steps can deadlock FSDP's collectives). A rank with
  fewer samples gets empty micro-steps (``num_samples == 0``), which run no forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from autoaccum.batch import Batch, SplitFn, split_batch
from autoaccum.plan import Plan, micro_sizes, micro_step_count

__all__ = ["Cutter", "MicroBatch", "SampleCut", "step_micro_sizes"]


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward's worth of samples; ``batch`` is None for an empty micro-step."""

    batch: Batch | None
    num_samples: int


class Cutter(Protocol):
    """Cuts ``batch`` (this rank's ``rank_sizes[rank]`` samples) into the micro-batches of one step under ``plan``."""

    def __call__(self, batch: Batch, rank_sizes: Sequence[int], rank: int, plan: Plan) -> Iterator[MicroBatch]: ...


def step_micro_sizes(rank_sizes: Sequence[int], rank: int, micro_batch: int,
                     min_micro_batch: int = 1) -> tuple[int, ...]:
    """Micro-batch sizes of ``rank`` in one step when the ranks hold ``rank_sizes`` samples: as many
    micro-steps on every rank as the largest share needs (at least one), each rank's samples
    spread evenly over its micro-batches (see :func:`autoaccum.plan.micro_sizes`)."""
    steps = max(1, micro_step_count(max(rank_sizes), micro_batch))
    return micro_sizes(rank_sizes[rank], micro_batch, steps, min_micro_batch)


@dataclass(frozen=True)
class SampleCut:
    """Cut by sample count: micro-batches of ``plan.micro_batch`` samples, consecutive, views of the batch.

    Attributes:
        split_fn: ``split_fn(batch, sizes) -> parts`` for batch types other than tensors and
            (nested) tuples, lists, dicts and namedtuples of them.
    """

    split_fn: SplitFn | None = None

    def __call__(self, batch: Batch, rank_sizes: Sequence[int], rank: int, plan: Plan) -> Iterator[MicroBatch]:
        sizes = step_micro_sizes(rank_sizes, rank, plan.micro_batch, plan.min_micro_batch)
        filled = [s for s in sizes if s > 0]
        parts = split_batch(batch, filled, self.split_fn) if filled else []
        parts.reverse()  # popped from the end: each part is released as soon as its micro-step is done
        for size in sizes:
            yield MicroBatch(parts.pop() if size > 0 else None, size)
