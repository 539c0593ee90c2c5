"""Cutting one rank's share of a global batch into the micro-batches of one optimizer step.

A cutter is passed to the guard (and to the evaluation), not hard-wired: how a batch is cut --
by samples, or by tokens for variable-length data -- is a choice of the caller. Every cutter
keeps two rules:

- the micro-batches of a step hold exactly the rank's samples, each once;
- every rank runs the same number of micro-steps. A cutter says how many this rank needs
  (``Cutter.steps``); the guard takes the largest over all ranks (ranks that run different
  numbers of micro-steps can deadlock FSDP's collectives) and the cutter fills the rest with empty
  micro-steps (``num_samples == 0``), which run no forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from autoaccum.plan.batch import Batch, Samples, SplitFn, like, split_batch
from autoaccum.plan.lengths import LengthFn, row_lengths
from autoaccum.plan.plan import Plan, micro_sizes, micro_step_count

__all__ = ["Cutter", "MicroBatch", "SampleCut", "TokenCut", "step_micro_sizes"]


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward's worth of samples; ``batch`` is None for an empty micro-step."""

    batch: Batch | None
    num_samples: int


class Cutter(Protocol):
    """How a rank's batch of a step becomes micro-batches under ``plan``."""

    def steps(self, batch: Batch, num_samples: int, plan: Plan) -> int:
        """The micro-steps this rank needs for ``batch`` (``num_samples`` samples)."""
        ...

    def __call__(self, batch: Batch, num_samples: int, plan: Plan, steps: int) -> Iterator[MicroBatch]:
        """Exactly ``steps`` micro-batches (empty ones last) holding the batch's ``num_samples`` samples."""
        ...


def step_micro_sizes(rank_sizes: Sequence[int], rank: int, micro_batch: int,
                     min_micro_batch: int = 1) -> tuple[int, ...]:
    """Micro-batch sizes of ``rank`` in one step when the ranks hold ``rank_sizes`` samples: as many
    micro-steps on every rank as the largest share needs (at least one), each rank's samples
    spread evenly over its micro-batches (see ``autoaccum.plan.plan.micro_sizes``)."""
    steps = max(1, micro_step_count(max(rank_sizes), micro_batch))
    return micro_sizes(rank_sizes[rank], micro_batch, steps, min_micro_batch)


@dataclass(frozen=True)
class SampleCut:
    """Cut by sample count: micro-batches of ``plan.micro_batch`` samples at most, consecutive, spread
    evenly, views of the batch (collated from ``Samples`` where given those).

    Attributes:
        split_fn: ``split_fn(batch, sizes) -> parts`` for batch types other than tensors and
            (nested) tuples, lists, dicts and namedtuples of them.
    """

    split_fn: SplitFn | None = None

    def steps(self, batch: Batch, num_samples: int, plan: Plan) -> int:
        return max(1, micro_step_count(num_samples, plan.micro_batch))

    def __call__(self, batch: Batch, num_samples: int, plan: Plan, steps: int) -> Iterator[MicroBatch]:
        sizes = micro_sizes(num_samples, plan.micro_batch, steps, plan.min_micro_batch)
        filled = [s for s in sizes if s > 0]
        parts = split_batch(batch, filled, self.split_fn) if filled else []
        parts.reverse()  # popped from the end: each part is released as soon as its micro-step is done
        for size in sizes:
            yield MicroBatch(parts.pop() if size > 0 else None, size)


class TokenCut:
    """Cut by tokens: the step's samples ordered by length, longest first, packed into micro-batches
    whose padded cost fits ``plan.tokens`` (``b * (L + quadratic * L**2 + per_sample)``, ``L`` the
    micro-batch's longest sample) and that hold at most ``plan.micro_batch`` samples; each micro-batch is padded
    only to its own longest sample. The global batch is never changed: every sample of the step is
    in one micro-batch. Without a token budget in the plan, micro-batches of ``plan.micro_batch``
    samples in length order (as Hugging Face's ``group_by_length`` does).

    Batches it cuts:
    - ``Samples`` (uncollated samples and their lengths): each micro-batch is
      collated by their ``collate_fn``;
    - a padded dict batch with an ``attention_mask``: rows are taken by length, and a right-padded
      batch's sequence columns (those as long as the batch) are trimmed to the micro-batch's longest
      row. A left-padded batch is not trimmed: a model reading positions from 0 would see its
      tokens at other positions.

    Args:
        length_fn: the length of a row of other batch types, if any (default: the attention mask).
    """

    def __init__(self, length_fn: LengthFn | None = None) -> None:
        self.length_fn = length_fn
        # the last batch cut (held, not its id: a freed batch's id is reused by the next one)
        self._cache: tuple[Batch, Plan, list[list[int]]] | None = None

    def _lengths(self, batch: Batch) -> list[int]:
        if isinstance(batch, Samples):
            return list(batch.lengths)
        if isinstance(batch, Mapping):
            return row_lengths(batch)
        raise TypeError(f"TokenCut cuts autoaccum.plan.batch.Samples or padded dict batches with an attention_mask, "
                        f"got a {type(batch).__name__}")

    def groups(self, batch: Batch, plan: Plan) -> list[list[int]]:
        """Sample indices of each micro-batch, the micro-batches of the longest samples first.

        With a token budget: the step's samples in length order, cut into runs that each fit the
        budget, choosing the runs that make the step cheapest by the plan's cost model -- each pass
        costs ``pass_cost`` plus its padded tokens -- so that padding is traded against passes by
        measurement (a dynamic programme over the sorted lengths: the cheapest cut of the shortest
        ``j`` samples extends the cheapest cut of a shorter prefix by one run). Without a token
        budget: runs of ``plan.micro_batch`` in length order. No run is below the model's smallest
        micro-batch; a single sample longer than the budget still runs (one sample must)."""
        if self._cache is not None and self._cache[0] is batch and self._cache[1] == plan:
            return self._cache[2]
        lengths = self._lengths(batch)
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        if plan.tokens is None:
            step = max(plan.micro_batch, plan.min_micro_batch)
            groups = [order[i:i + step] for i in range(0, len(order), step)]
            if len(groups) > 1 and len(groups[-1]) < plan.min_micro_batch:
                groups[-2].extend(groups.pop())
        else:
            groups = [[order[i] for i in run] for run in _cheapest_runs([lengths[i] for i in order], plan)]
        groups.reverse()  # longest first: a step that runs out of memory does so early, losing little
        self._cache = (batch, plan, groups)
        return groups

    def steps(self, batch: Batch, num_samples: int, plan: Plan) -> int:
        return max(1, len(self.groups(batch, plan))) if num_samples else 1

    def __call__(self, batch: Batch, num_samples: int, plan: Plan, steps: int) -> Iterator[MicroBatch]:
        groups = self.groups(batch, plan) if num_samples else []
        if len(groups) > steps:
            raise ValueError(f"{len(groups)} micro-batches do not fit in {steps} micro-steps")
        for group in groups:
            yield MicroBatch(self._take(batch, group), len(group))
        for _ in range(steps - len(groups)):
            yield MicroBatch(None, 0)

    def _take(self, batch: Batch, rows: list[int]) -> Batch:
        if isinstance(batch, Samples):
            return batch.take(rows)
        index = torch.tensor(sorted(rows))
        mask = batch["attention_mask"]
        padded = mask.shape[1]
        longest = int(mask[index].sum(dim=1).max())
        right_padded = bool((mask[:, 0] == 1).all())
        keep = longest if right_padded else padded
        return like(batch, ((k, _rows(v, index, padded, keep)) for k, v in batch.items()))


def _rows(value: Any, index: torch.Tensor, padded: int, keep: int) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    rows = value[index]
    if keep < padded and rows.dim() >= 2 and rows.shape[1] == padded:
        rows = rows[:, :keep]
    return rows


def _cheapest_runs(lengths: list[int], plan: Plan) -> list[range]:
    """Runs of ascending ``lengths`` minimising the sum of ``pass_cost + count * unit(longest)``, each
    run within the budget and ``plan.micro_batch`` (see ``TokenCut.groups``)."""
    tokens = plan.tokens
    assert tokens is not None
    n, smallest = len(lengths), max(1, plan.min_micro_batch)
    best = [0.0] + [math.inf] * n
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[j - 1]
        unit = tokens.unit(longest)
        cap = min(plan.micro_batch, max(tokens.max_batch(longest), smallest))
        for i in range(max(0, j - cap), j - min(smallest, j) + 1):
            cost = best[i] + tokens.pass_cost + (j - i) * unit
            if cost < best[j]:
                best[j], start[j] = cost, i
    runs, j = [], n
    while j > 0:
        runs.append(range(start[j], j))
        j = start[j]
    return runs[::-1]
