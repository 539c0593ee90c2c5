"""Global batches from the user's data: exactly ``target_batch`` samples per optimizer step.

Five kinds of data: a tuple/list of tensors sharing dim 0 (indexed directly, no copies per
sample); a dict (or ``BatchEncoding``) of such tensors, e.g. a tokenizer's output, batched as dicts
of the same keys and type; a map-style dataset (``__len__`` and ``__getitem__``), batched by
``collate_fn`` (default ``default_collate``; a padding collator such as Hugging Face's works as it
is); an ``IterableDataset``, whose items are always single samples (as a DataLoader takes them),
cut in its order into global batches and collated as a map-style dataset's (every rank reads the
whole stream and keeps its share; ``seed`` does not reorder it); any other iterable (a DataLoader,
a generator) that yields global batches -- under torch.distributed, each rank's share.

For the indexed kinds, epoch ``e`` visits the samples in the order
``torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + e))``
(a fresh permutation per epoch that a resumed run draws again; the factor keeps ``(seed, e)`` and
``(seed + 1, e - 1)`` apart), cut into consecutive global batches of ``target_batch``, each split
over ranks in rank order (``autoaccum.plan.plan.rank_share``). The epoch's last batch, when the
samples do not fill it (``last_batch``), is a real, exactly weighted step on the samples that
remain (``"step"``, the default: nothing dropped, nothing repeated), or not trained on in this
epoch (``"drop"``; the next epoch's order differs).

Variable-length data (``by_length``): a map-style dataset's global batches come as ``Samples``
(uncollated, with lengths), so that each micro-batch is collated -- padded -- on its own; a dict of
tensors comes as padded rows that ``autoaccum.plan.cut.TokenCut`` trims. ``length_profile`` reads
the lengths a plan is made for (all, or an evenly spaced ``LENGTH_SAMPLE`` of a large dataset), and
``sample_at`` makes the probe's batches of ``b`` samples at one length.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from autoaccum.plan.batch import Batch, Samples, batch_size, first_difference, like, split_batch, structure
from autoaccum.plan.lengths import LengthFn, LengthProfile, checked_length_fn, item_length, row_lengths
from autoaccum.plan.plan import rank_share
from autoaccum.state import capture_rng, restore_rng
from autoaccum.validate import check_choice, check_positive_int

__all__ = ["LENGTH_SAMPLE", "GlobalBatches", "LastBatch", "RankBatch"]

LastBatch = Literal["step", "drop"]
#: lengths read at most to plan variable-length data (evenly spaced over a larger dataset)
LENGTH_SAMPLE = 10_000
_COLLATE_SAMPLE = 32  # samples whose structures are compared before any work (default_collate must stack them)


@dataclass(frozen=True)
class RankBatch:
    """This rank's share of one global batch."""

    batch: Batch
    epoch: int
    index: int  # global batch number within the epoch
    global_size: int  # samples in the global batch, all ranks together
    partial: bool  # the epoch's smaller last batch


def _tensor_columns(data: Any) -> Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None:
    """``data`` when it is a tuple/list or dict of tensors (the indexed-tensor kind), else None."""
    if isinstance(data, torch.Tensor):
        return (data,)
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        if isinstance(data, list) and len(data) > max(t.shape[0] if t.dim() else 0 for t in data):
            return None  # more "columns" than rows: a list of samples (a dataset), e.g. token sequences
        return data
    if isinstance(data, Mapping) and data and all(isinstance(t, torch.Tensor) for t in data.values()):
        return data
    return None


class GlobalBatches:
    """Draws global batches from ``data`` epoch by epoch, reproducibly, for one rank.

    Args:
        data: see the module docstring.
        target_batch: samples per optimizer step over all ranks.
        seed: the data order's seed.
        rank: this process's rank among the data-parallel ranks.
        world_size: the number of data-parallel ranks.
        collate_fn: batches a list of dataset items (datasets only, map-style or iterable).
        last_batch: ``"step"`` or ``"drop"`` (see the module docstring).
        by_length: variable-length data: a map-style dataset's batches come as ``Samples``.
        length_fn: the length of one dataset item (default ``autoaccum.plan.lengths.item_length``).
        name: the argument the data came as, in messages (``data``, ``eval_data``).
    """

    def __init__(self, data: Any, target_batch: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 collate_fn: Callable[[list[Any]], Batch] | None = None, last_batch: LastBatch = "step",
                 by_length: bool = False, length_fn: LengthFn | None = None, name: str = "data") -> None:
        self.target_batch = check_positive_int(target_batch, "target_batch")
        self.last_batch = check_choice(last_batch, "last_batch", ("step", "drop"))
        self.seed, self.rank, self.world_size, self.name = seed, rank, world_size, name
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.by_length, self.length_fn = by_length, item_length if length_fn is None else checked_length_fn(length_fn)
        self._lengths: tuple[list[int], list[int] | None, str] | None = None
        self.columns: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None = None
        self.dataset: Any = None
        self.iterable: Iterable[Batch] | None = None
        self.stream: IterableDataset | None = None  # an IterableDataset: single samples, batched here
        self._stream_head: list[Any] = []  # its first samples, read for the probe and the checks
        self._head: list[Batch] = []  # the first batch of a one-shot iterator, taken by sample()
        self._head_pending = False  # ... and not yet yielded by epoch()
        columns, self._bare = _tensor_columns(data), isinstance(data, torch.Tensor)
        if columns is not None:
            tensors = list(columns.values()) if isinstance(columns, Mapping) else list(columns)
            sizes = {t.shape[0] if t.dim() else None for t in tensors}
            if len(sizes) != 1 or None in sizes:
                raise ValueError(f"the tensors of data disagree in dim 0 (sizes {sorted(map(str, sizes))}); each "
                                 f"tensor must hold one row per sample")
            self.columns = columns
            self.num_samples: int | None = int(tensors[0].shape[0])
        elif isinstance(data, IterableDataset):  # before the map-style test: Dataset defines __getitem__
            self.stream = data
            self.num_samples = len(data) if hasattr(data, "__len__") else None
        elif hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, (str, bytes, Mapping)):
            self.dataset = data
            self.num_samples = len(data)
        elif isinstance(data, Iterable) and not isinstance(data, (str, bytes, Mapping)):
            self.iterable = data
            self.num_samples = len(data) * target_batch if hasattr(data, "__len__") else None
        else:
            raise TypeError(f"data must be a tuple or dict of tensors, a map-style Dataset or an iterable of batches, "
                            f"got {type(data).__name__}" + (" (a dict whose values are not all tensors)"
                                                            if isinstance(data, Mapping) else ""))
        if self.num_samples == 0:
            raise ValueError("data is empty: there is nothing to train on")
        if self.iterable is None and self.num_samples is not None and self.num_samples < world_size:
            raise ValueError(f"data holds {self.num_samples} samples, fewer than the {world_size} ranks")

    @property
    def one_shot(self) -> bool:
        """An iterator (a generator): its batches run out after one pass."""
        return isinstance(self.iterable, Iterator)

    @property
    def is_indexed(self) -> bool:
        return self.iterable is None

    @property
    def share(self) -> int:
        """This rank's samples of a full global batch."""
        bounds = rank_share(self.target_batch, self.rank, self.world_size)
        return bounds.stop - bounds.start

    @property
    def steps_per_epoch(self) -> int | None:
        if self.iterable is not None or self.num_samples is None:
            return len(self.iterable) if hasattr(self.iterable, "__len__") else None
        full, rest = divmod(self.num_samples, self.target_batch)
        return full + (1 if rest and self.last_batch == "step" else 0)

    @property
    def last_global_size(self) -> int | None:
        """Samples of the epoch's last, smaller global batch (None where there is none, or it is dropped
        or unknown)."""
        if self.iterable is not None or self.num_samples is None or self.last_batch == "drop":
            return None
        return (self.num_samples % self.target_batch) or None  # type: ignore[operator]

    def _gather(self, indices: torch.Tensor) -> Batch:
        if isinstance(self.columns, Mapping):
            return like(self.columns, ((k, t[indices]) for k, t in self.columns.items()))
        if self.columns is not None:
            # a bare tensor comes back bare, a tuple (a 1-tuple too) as a tuple: the loss reads what it was given
            return self.columns[0][indices] if self._bare else tuple(t[indices] for t in self.columns)
        return self._collate([self.dataset[int(i)] for i in indices], lambda: self.dataset[0])

    def _collate(self, items: list[Any], spare: Callable[[], Any]) -> Batch:
        """A dataset's (or stream's) samples as a batch: collated, or as ``Samples`` for ``by_length``. No
        samples (a rank's share of a small last batch) are no rows of a ``spare()`` sample collated."""
        if self.by_length:  # collated per micro-batch, by the cutter
            return Samples(tuple(items), tuple(self.length_fn(item) for item in items), self.collate_fn)
        return self.collate_fn(items) if items else split_batch(self.collate_fn([spare()]), [0, 1])[0]

    # -- variable-length data -------------------------------------------------------------------------
    def lengths(self, limit: int = LENGTH_SAMPLE) -> tuple[list[int], list[int] | None, str]:
        """``(lengths, indices, source)``: the lengths of all samples, or of ``limit`` evenly spaced
        ones; the sample indices they belong to (None for an iterable's first batch); in words. Read once."""
        if self._lengths is None:
            self._lengths = self._read_lengths(limit)
        return self._lengths

    def _read_lengths(self, limit: int) -> tuple[list[int], list[int] | None, str]:
        if self.iterable is not None:
            first = self._first_batch()
            return row_lengths(first), None, "the first batch (an iterable's other batches are not read ahead)"
        if self.columns is not None and not isinstance(self.columns, Mapping):
            raise TypeError("a tuple of tensors has no sample lengths; give a dict with an 'attention_mask', or a "
                            "dataset of samples and length_fn=")
        if self.stream is not None:
            head = self._head_items(limit)
            return [self.length_fn(item) for item in head], list(range(len(head))), \
                f"the stream's first {len(head):,} samples"
        n = self.num_samples  # type: ignore[assignment]
        indices = list(range(n)) if n <= limit else [int(i * n / limit) for i in range(limit)]
        source = f"all {n:,} samples" if n <= limit else f"{limit:,} of {n:,} samples, evenly spaced"
        if isinstance(self.columns, Mapping):
            lengths = row_lengths(like(self.columns, ((k, t[indices]) for k, t in self.columns.items())))
        else:
            lengths = [self.length_fn(self.dataset[i]) for i in indices]
        return lengths, indices, source

    def length_profile(self, limit: int = LENGTH_SAMPLE) -> LengthProfile:
        lengths, _, source = self.lengths(limit)
        return LengthProfile.of(lengths, total=self.num_samples, source=source)

    def sample_at(self, size: int, length: int) -> Batch:
        """``size`` samples of ``length`` (repeated where the data has fewer), padded to it: a probe batch."""
        lengths, indices, _ = self.lengths()
        rows = [i for i, n in enumerate(lengths) if n == length] or \
            [max(range(len(lengths)), key=lambda i: lengths[i] if lengths[i] <= length else -1)]
        picked = [rows[i % len(rows)] for i in range(size)]
        if self.iterable is not None:
            first = self._first_batch()
            return _trim(like(first, ((k, _row_pick(v, picked)) for k, v in first.items())), length)
        chosen = torch.tensor([indices[i] for i in picked])  # type: ignore[index]
        if isinstance(self.columns, Mapping):
            return _trim(self._gather(chosen), length)
        source = self.dataset if self.stream is None else self._stream_head
        return self.collate_fn([source[int(i)] for i in chosen])

    def _head_items(self, count: int) -> list[Any]:
        """The stream's first ``count`` samples (fewer where it holds fewer), read from a fresh pass whose
        draws from the global RNG (a shuffle buffer's) are put back: reading them leaves no trace."""
        if len(self._stream_head) < count:
            rng = capture_rng()
            self._stream_head = list(itertools.islice(iter(self.stream), count))  # type: ignore[arg-type]
            restore_rng(rng)
        if not self._stream_head:
            raise ValueError(f"{self.name} yielded no sample: there is nothing to train on (an empty IterableDataset?)")
        return self._stream_head[:count]

    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)  # type: ignore[arg-type]

    def epoch(self, epoch: int, start: int = 0) -> Iterator[RankBatch]:
        """This rank's batches of ``epoch``, from global batch number ``start`` on."""
        if self.iterable is not None or self.stream is not None:
            yield from self._iterable_epoch(epoch, start) if self.stream is None else self._stream_epoch(epoch, start)
            return
        order = self._order(epoch)
        for index in range(start, self.steps_per_epoch):  # type: ignore[arg-type]
            chunk = order[index * self.target_batch:(index + 1) * self.target_batch]
            mine = chunk[rank_share(len(chunk), self.rank, self.world_size)]
            yield RankBatch(self._gather(mine), epoch, index, len(chunk), len(chunk) < self.target_batch)

    def _stream_epoch(self, epoch: int, start: int) -> Iterator[RankBatch]:
        """A stream's samples cut in its order into global batches, this rank's share of each collated."""
        iterator = iter(self.stream)  # type: ignore[arg-type]
        skip = start * self.target_batch  # resuming: exact only if the stream repeats its order
        next(itertools.islice(iterator, skip, skip), None)
        for index in itertools.count(start):
            chunk = list(itertools.islice(iterator, self.target_batch))
            if not chunk or (len(chunk) < self.target_batch and self.last_batch == "drop"):
                return
            mine = chunk[rank_share(len(chunk), self.rank, self.world_size)]
            batch = self._collate(mine, lambda: chunk[0])
            yield RankBatch(batch, epoch, index, len(chunk), len(chunk) < self.target_batch)

    def _iterable_epoch(self, epoch: int, start: int) -> Iterator[RankBatch]:
        share = self.share
        iterator = iter(self.iterable)  # type: ignore[arg-type]
        if self._head_pending:  # sample() took the first batch of a one-shot iterator: it comes first
            iterator, self._head_pending = itertools.chain(self._head, iterator), False
        ahead = next(iterator, None)
        index = 0
        while ahead is not None:
            batch, ahead = ahead, next(iterator, None)  # look one ahead: only the last may be short
            if index >= start:  # resuming: an iterable is exact to resume only if it repeats its order
                n = batch_size(batch)
                if n > share or (n < share and ahead is not None):
                    raise ValueError(self._size_message(n, f"a batch at position {index}"))
                if n < share and self.last_batch == "drop":
                    return
                yield RankBatch(batch, epoch, index, n * self.world_size, ahead is None and n < share)
            index += 1

    def _size_message(self, n: int, what: str) -> str:
        return (f"{self.name} yielded {what} of {n} samples, but target_batch is {self.target_batch} over "
                f"{self.world_size} rank(s), so every batch but the last must hold this rank's share "
                f"({self.share}). The global batch is never changed silently: pass target_batch={n * self.world_size} "
                f"to train on batches of {n}, batch the loader at {self.share}, or give fit the dataset (not a "
                f"DataLoader) and let it batch.")

    def check(self) -> None:
        """Fail before any work on data that cannot make global batches: samples ``default_collate`` cannot
        stack; a DataLoader of single samples (``batch_size=None``), or whose ``batch_size`` differs from
        this rank's share, or whose first batch holds more than it (or fewer, unless it is known to be the only one)."""
        if self.iterable is None:
            self._check_collatable()
            return
        if isinstance(self.iterable, DataLoader) and self.iterable.batch_size is None \
                and self.iterable.batch_sampler is None:
            raise ValueError(f"{self.name} is a DataLoader with batch_size=None: it yields single samples, not "
                             f"batches (a sample's first dim would be taken for its samples). Pass batch_size="
                             f"{self.share} (this rank's share of target_batch={self.target_batch}) to the DataLoader, "
                             f"or give fit the loader's dataset ({self.name}=loader.dataset, with collate_fn= if it "
                             f"needs one) to batch")
        loader_batch = getattr(self.iterable, "batch_size", None)
        if isinstance(loader_batch, int) and loader_batch != self.share:
            raise ValueError(self._size_message(loader_batch, "batches (DataLoader batch_size)"))
        n = batch_size(self._first_batch())
        # fewer with more to come, or from an iterator of unknown length (whose later batches would be short too)
        more = len(self.iterable) > 1 if hasattr(self.iterable, "__len__") else True  # type: ignore[arg-type]
        if n > self.share or (n < self.share and more):
            raise ValueError(self._size_message(n, "a first batch"))

    def _check_collatable(self) -> None:
        """Samples ``default_collate`` cannot stack (sequences of different lengths), found among up to
        ``_COLLATE_SAMPLE`` evenly spaced ones before any work. A ``collate_fn`` of the user's is trusted."""
        if self.columns is not None or self.collate_fn is not default_collate:
            return
        n = _COLLATE_SAMPLE if self.num_samples is None else min(self.num_samples, _COLLATE_SAMPLE)
        indices = list(range(n)) if self.stream is not None else \
            [int(i * self.num_samples / n) for i in range(n)]  # type: ignore[operator]
        items = self._head_items(n) if self.stream is not None else [self.dataset[i] for i in indices]
        first = structure(items[0])
        for index, item in zip(indices[1:], items[1:]):
            found = first_difference(first, structure(item))
            if found is not None:
                raise ValueError(
                    f"{self.name}'s samples differ in shape: sample {indices[0]}{found[0]} is {found[1]}, sample "
                    f"{index}{found[0]} is {found[2]}, and default_collate stacks samples of one shape only. "
                    f"Sequences of different lengths need a collate_fn= that pads them (e.g. transformers' "
                    f"DataCollatorWithPadding, or one built on torch.nn.utils.rnn.pad_sequence); with length_fn= (e.g. "
                    f"length_fn=len) or by_length=True fit also plans and cuts them by tokens")

    def check_like(self, other: GlobalBatches) -> None:
        """``check``, then refuse batches whose structure, shapes (but the batch dim, and the sequence dim of
        variable-length data) or dtypes differ from ``other``'s: evaluation data the model cannot take."""
        self.check()
        free = 2 if other.by_length else 1
        mine, theirs = (structure(_collated(b.sample(1)), free) for b in (self, other))
        found = first_difference(theirs, mine)
        if found is not None:
            path, want, got = found
            raise ValueError(
                f"{self.name}'s batches differ from {other.name}'s: {self.name}{path} is {got}, {other.name}{path} is "
                f"{want} (* is the batch dim{', and the sequence dim' if free == 2 else ''}, free to differ). Give "
                f"{self.name} samples of {other.name}'s structure, shapes and dtypes")

    def sample(self, size: int, repeat: bool = False) -> Batch:
        """``size`` samples for the probe: the first of epoch 0's order (or of the first batch); with
        ``repeat``, data holding fewer is drawn again from its start (indexed data)."""
        if self.iterable is not None:
            first = self._first_batch()
            have = batch_size(first)
            if size > have:
                raise ValueError(f"the probe needs {size} samples but the data's batches hold {have}")
            return split_batch(first, [size, have - size])[0]
        if self.stream is not None:
            head = self._head_items(size)
            if len(head) < size and not repeat:
                raise ValueError(f"the probe asked for {size} samples but {self.name} yields only {len(head)}")
            return self._collate([head[i % len(head)] for i in range(size)], lambda: head[0])
        n = self.num_samples
        if size > n and not repeat:  # type: ignore[operator]
            raise ValueError(f"the probe asked for {size} samples but data holds only {n}")
        order = self._order(0)
        return self._gather(order[:size] if size <= n else order[torch.arange(size) % n])  # type: ignore[operator]

    def _first_batch(self) -> Batch:
        """The iterable's first batch, fetched once for the probe. A one-shot iterator (a generator) keeps it for
        ``epoch()`` to yield first (probing drops no batch); a re-iterable (a DataLoader) is iterated afresh, the
        global RNG it drew from (a shuffling sampler's seed) put back (probing leaves no trace)."""
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


def _collated(batch: Batch) -> Batch:
    return batch.take(range(len(batch))) if isinstance(batch, Samples) else batch


def _row_pick(value: Any, rows: list[int]) -> Any:
    return value[torch.tensor(rows)] if isinstance(value, torch.Tensor) and value.dim() > 0 else value


def _trim(batch: Any, length: int) -> Any:
    """A right-padded dict batch's sequence columns (those as long as its attention mask) cut to ``length``."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] <= length:
        return batch
    padded = mask.shape[1]
    return like(batch, ((k, v[:, :length] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == padded
                         else v) for k, v in batch.items()))
