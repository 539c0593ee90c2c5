"""Global batches from the user's data: exactly ``target_batch`` samples per optimizer step.

Three kinds of data:
- a tuple/list of tensors sharing dim 0 (indexed directly, no copies per sample);
- a map-style dataset (``__len__`` and ``__getitem__``), collated with ``default_collate``;
- any other iterable (a DataLoader, a generator) that already yields global batches -- under
  torch.distributed, each rank's iterable yields that rank's share.

For the first two, epoch ``e`` visits the samples in the order
``torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + e))``
(a fresh permutation per epoch that a resumed run draws again; the factor keeps ``(seed, e)`` and
``(seed + 1, e - 1)`` apart), cut into consecutive global batches of ``target_batch``; the last batch of
an epoch holds the samples that remain and is a real, exactly weighted step on them (nothing
dropped, nothing repeated). Each global batch is split over ranks in rank order, rank ``r``
taking ``plan.rank_batch(r)`` consecutive samples (fewer in the last, partial batch).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from autoaccum.batch import Batch, batch_size
from autoaccum.plan import rank_share
from autoaccum.validate import check_positive_int
from autoaccum.state import capture_rng, restore_rng

__all__ = ["GlobalBatches", "RankBatch"]


@dataclass(frozen=True)
class RankBatch:
    """This rank's share of one global batch."""

    batch: Batch
    epoch: int
    index: int  # global batch number within the epoch
    global_size: int  # samples in the global batch, all ranks together
    partial: bool  # the epoch's smaller last batch


class GlobalBatches:
    """Draws global batches from ``data`` epoch by epoch, reproducibly, for one rank."""

    def __init__(self, data: Any, target_batch: int, *, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        self.target_batch = check_positive_int(target_batch, "target_batch")
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.tensors: tuple[torch.Tensor, ...] | None = None
        self.dataset: Any = None
        self.iterable: Iterable[Batch] | None = None
        self._head: list[Batch] = []  # the first batch of a one-shot iterator, taken by sample()
        self._head_pending = False  # ... and not yet yielded by epoch()
        if isinstance(data, torch.Tensor):
            data = (data,)
        if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
            sizes = {t.shape[0] if t.dim() else None for t in data}
            if len(sizes) != 1 or None in sizes:
                raise ValueError(f"the tensors of data disagree in dim 0 (sizes {sorted(map(str, sizes))}); each "
                                 f"tensor must hold one row per sample")
            self.tensors = tuple(data)
            self.num_samples: int | None = int(data[0].shape[0])
        elif hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, (str, bytes, dict)):
            self.dataset = data
            self.num_samples = len(data)
        elif isinstance(data, Iterable):
            self.iterable = data
            self.num_samples = len(data) * target_batch if hasattr(data, "__len__") else None
        else:
            raise TypeError(f"data must be a tuple of tensors, a map-style Dataset or an iterable of batches, got "
                            f"{type(data).__name__}")
        if self.num_samples == 0:
            raise ValueError("data is empty: there is nothing to train on")
        if self.iterable is None and self.num_samples is not None and self.num_samples < world_size:
            raise ValueError(f"data holds {self.num_samples} samples, fewer than the {world_size} ranks")

    @property
    def is_indexed(self) -> bool:
        return self.iterable is None

    @property
    def steps_per_epoch(self) -> int | None:
        if self.iterable is not None:
            return len(self.iterable) if hasattr(self.iterable, "__len__") else None
        return math.ceil(self.num_samples / self.target_batch)  # type: ignore[operator]

    def _gather(self, indices: torch.Tensor) -> Batch:
        if self.tensors is not None:
            return tuple(t[indices] for t in self.tensors) if len(self.tensors) > 1 else self.tensors[0][indices]
        return default_collate([self.dataset[int(i)] for i in indices])

    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)  # type: ignore[arg-type]

    def epoch(self, epoch: int, start: int = 0) -> Iterator[RankBatch]:
        """This rank's batches of ``epoch``, from global batch number ``start`` on."""
        if self.iterable is not None:
            bounds = rank_share(self.target_batch, self.rank, self.world_size)
            share = bounds.stop - bounds.start  # this rank's samples of a full global batch
            iterator = iter(self.iterable)
            if self._head_pending:  # sample() took the first batch of a one-shot iterator: it comes first
                iterator, self._head_pending = itertools.chain(self._head, iterator), False
            ahead = next(iterator, None)
            index = 0
            while ahead is not None:
                batch, ahead = ahead, next(iterator, None)  # look one ahead: only the last may be short
                if index >= start:  # resuming: an iterable is exact to resume only if it repeats its order
                    n = batch_size(batch)
                    if n > share or (n < share and ahead is not None):
                        raise ValueError(
                            f"the data yielded a batch of {n} samples at position {index}; with target_batch "
                            f"{self.target_batch} over {self.world_size} rank(s) every batch but the last must hold "
                            f"this rank's share ({share}). The global batch is never changed silently: batch the "
                            f"loader at the target (or pass a tuple of tensors / a Dataset and let fit batch it)")
                    yield RankBatch(batch, epoch, index, n * self.world_size, ahead is None and n < share)
                index += 1
            return
        order = self._order(epoch)
        for index in range(start, self.steps_per_epoch):  # type: ignore[arg-type]
            chunk = order[index * self.target_batch:(index + 1) * self.target_batch]
            mine = chunk[rank_share(len(chunk), self.rank, self.world_size)]
            yield RankBatch(self._gather(mine), epoch, index, len(chunk), len(chunk) < self.target_batch)

    def sample(self, size: int) -> Batch:
        """``size`` samples for the probe: the first of epoch 0's order (or of the first batch)."""
        if self.iterable is not None:
            first = self._first_batch()
            have = batch_size(first)
            if size > have:
                raise ValueError(f"the probe needs {size} samples but the data's batches hold {have}")
            from autoaccum.batch import split_batch

            return split_batch(first, [size, have - size])[0]
        if size > self.num_samples:  # type: ignore[operator]
            raise ValueError(f"the probe asked for {size} samples but data holds only {self.num_samples}")
        return self._gather(self._order(0)[:size])

    def _first_batch(self) -> Batch:
        """The iterable's first batch, fetched once for all of the probe's samples.

        A one-shot iterator (a generator) keeps it for ``epoch()`` to yield first, so probing drops
        no batch. A re-iterable (a DataLoader) is iterated afresh; the global RNG it drew from (a
        shuffling DataLoader seeds its sampler from it) is put back, so probing leaves no trace."""
        if self._head:
            return self._head[0]
        one_shot = isinstance(self.iterable, Iterator)  # iter() of a DataLoader would draw from the RNG
        rng = None if one_shot else capture_rng()
        first = next(iter(self.iterable), None)  # type: ignore[arg-type]
        if rng is not None:
            restore_rng(rng)
        if first is None:
            raise ValueError("data yielded no batch: there is nothing to train on (an exhausted or empty iterable?)")
        self._head, self._head_pending = [first], one_shot
        return first
