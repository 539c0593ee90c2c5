"""Batches as nested containers of tensors: their size, their device, and cutting them along dim 0."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Batch", "Samples", "SplitFn", "batch_size", "describe_batch", "first_difference", "like", "map_tensors",
           "move_to", "own_rows", "split_batch", "structure", "tensors"]

Batch = Any  # a tensor, or a tuple/list/dict (nested) whose tensors share dim 0
SplitFn = Callable[[Batch, Sequence[int]], Sequence[Batch]]


def tensors(batch: Batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):  # before the Mapping check: an ABC's isinstance is slow
        return [t for v in batch for t in tensors(v)]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in tensors(v)]
    return []


def like(batch: Mapping, items: Iterable[tuple[Any, Any]]) -> Mapping:
    """A mapping of ``batch``'s type (dict, ``BatchEncoding``, ...) holding ``items``."""
    if type(batch) is dict:
        return dict(items)
    items = list(items)
    try:
        return type(batch)(items)
    except TypeError:  # e.g. defaultdict, whose first argument is its default factory
        out = copy.copy(batch)
        out.clear()
        out.update(items)
        return out


@dataclass(frozen=True)
class Samples:
    """Uncollated samples of one global batch (or a rank's share of it), with their lengths.

    Variable-length data travels this way so that each micro-batch is collated -- padded to its own
    longest sample -- only when it is cut (``autoaccum.plan.cut.TokenCut``).

    Attributes:
        items: the samples, as the dataset returned them.
        lengths: each sample's length (``autoaccum.plan.lengths``).
        collate_fn: batches a list of samples (e.g. a padding collator).
    """

    items: tuple[Any, ...]
    lengths: tuple[int, ...]
    collate_fn: Callable[[list[Any]], Batch]

    def __len__(self) -> int:
        return len(self.items)

    def take(self, indices: Sequence[int]) -> Batch:
        """The samples at ``indices``, collated."""
        return self.collate_fn([self.items[i] for i in indices])


def batch_size(batch: Batch) -> int:
    """The number of samples in ``batch``: the shared dim 0 of its tensors.

    A list of samples (``[(x_0, y_0), (x_1, y_1), ...]``, as a Dataset returns them) is not a batch: it is
    refused, not collated (which collation is the caller's: ``default_collate``, or a padding one).

    Raises:
        ValueError: no tensor with a dim 0, tensors disagree on dim 0, or a list of samples.
    """
    if isinstance(batch, Samples):
        return len(batch)
    sizes = {t.shape[0] for t in tensors(batch) if t.dim() > 0}
    if type(batch) is list and batch and isinstance(batch[0], (tuple, list, Mapping)):
        _refuse_sample_list(batch, sizes)
    if not sizes:
        raise ValueError(
            f"cannot tell the batch size of a {type(batch).__name__}: expected a tensor or a tuple/list/dict "
            f"of tensors with the samples along dim 0 (pass split_fn= and size_fn= for other batch types)")
    if len(sizes) > 1:
        raise ValueError(f"the tensors of a batch disagree in dim 0: sizes {sorted(sizes)}; every tensor of a "
                         f"batch must hold one row per sample")
    return sizes.pop()


def _refuse_sample_list(batch: list, sizes: set[int]) -> None:
    """Refuse a list of samples (``[(x_0, y_0), (x_1, y_1), ...]``) given as a batch: its items share one
    structure, and their tensors' dim 0 is no batch dim (a scalar leaf, or dim-0 sizes that disagree). A
    nested batch such as ``[(ids, mask), (ids2, mask2)]``, every tensor sharing dim 0, is left alone."""
    first = structure(batch[0])
    if any(structure(item) != first for item in batch[1:]):
        return
    scalar = any(t.dim() == 0 for t in tensors(batch)) or any(_has_number(item) for item in batch)
    if scalar or len(sizes) > 1:
        raise ValueError(
            f"the batch is a list of {len(batch)} samples, each {_describe(first)}, not a batch of tensors sharing "
            f"dim 0 (counted by dim 0 it would hold {sorted(sizes)} samples). Collate the samples first: "
            f"torch.utils.data.default_collate(samples) gives one tensor per field, the samples along dim 0")


def _has_number(item: Any) -> bool:
    if isinstance(item, (int, float)):
        return True
    if isinstance(item, (list, tuple)):
        return any(_has_number(v) for v in item)
    return isinstance(item, Mapping) and any(_has_number(v) for v in item.values())


def structure(item: Any, free_dims: int = 0) -> tuple:
    """What collating depends on, as a comparable value: containers' kinds, lengths and keys, and each
    tensor's (or array's) shape and dtype, its first ``free_dims`` dims left out (None)."""
    if isinstance(item, torch.Tensor) or (hasattr(item, "shape") and hasattr(item, "dtype")):
        shape = tuple(item.shape)
        return ("tensor", tuple(None if i < free_dims else n for i, n in enumerate(shape)), str(item.dtype))
    if isinstance(item, Mapping):
        return ("dict", tuple((k, structure(v, free_dims)) for k, v in item.items()))
    if isinstance(item, (tuple, list)):
        return (type(item).__name__, tuple(structure(v, free_dims) for v in item))
    return ("number",) if isinstance(item, (int, float)) and not isinstance(item, bool) else (type(item).__name__,)


def _describe(node: tuple) -> str:
    if node[0] == "tensor":
        return f"a {node[2]} tensor of shape [{', '.join('*' if n is None else str(n) for n in node[1])}]"
    if node[0] == "dict":
        return f"a dict of keys {[k for k, _ in node[1]]}"
    if len(node) > 1:
        items = [_describe(v) for v in node[1]]
        inner = f"each {items[0]}" if len(items) > 3 and len(set(items)) == 1 else \
            ", ".join(items[:3]) + (", ..." if len(items) > 3 else "")
        return f"a {node[0]} of {len(items)} ({inner})"
    return f"a {node[0]}"


def first_difference(a: tuple, b: tuple, path: str = "") -> tuple[str, str, str] | None:
    """Where two ``structure`` values first differ: ``(path, a in words, b in words)``, or None if equal."""
    if a == b:
        return None
    sequences = a[0] in ("list", "tuple") and b[0] in ("list", "tuple")  # collated alike: not a difference
    same_kind = (a[0] == b[0] or sequences) and a[0] != "tensor" and len(a) > 1 and len(a[1]) == len(b[1])
    if same_kind and (a[0] != "dict" or [k for k, _ in a[1]] == [k for k, _ in b[1]]):
        for i, (x, y) in enumerate(zip(a[1], b[1])):
            key, x, y = (x[0], x[1], y[1]) if a[0] == "dict" else (i, x, y)
            found = first_difference(x, y, f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    return path, _describe(a), _describe(b)


def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """``batch`` with ``fn`` applied to each of its tensors, containers rebuilt as their own types."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return like(batch, ((k, map_tensors(v, fn)) for k, v in batch.items()))
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def move_to(batch: Batch, device: torch.device, *, copy: bool = False) -> Batch:
    """``batch`` with every tensor on ``device`` (non-blocking where the source is pinned); ``copy``
    copies tensors already there too (as a transfer to a device would allocate them). A tensor, or a
    plain tuple, list or dict of tensors, already all on ``device`` is returned as it is (the common
    case, once per micro-batch: no containers rebuilt)."""
    if not copy and _all_on(batch, device):
        return batch

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device != device or copy:
            return t.to(device, non_blocking=t.is_pinned(), copy=copy)
        return t
    return map_tensors(batch, move)


def _all_on(batch: Batch, device: torch.device) -> bool:
    """``batch`` is a tensor, or a plain tuple, list or dict of tensors, all on ``device`` (False for
    anything else: then ``move_to`` walks it)."""
    if type(batch) is torch.Tensor:
        return batch.device == device
    kind = type(batch)
    if kind is tuple or kind is list:
        items = batch
    elif kind is dict:
        items = batch.values()  # type: ignore[union-attr]
    else:
        return False
    for t in items:  # a loop, not all() over a generator: once per micro-batch
        if type(t) is not torch.Tensor or t.device != device:
            return False
    return True


def own_rows(batch: Batch) -> Batch:
    """``batch`` with each tensor that is a view into a larger one (rows sliced from a dataset tensor)
    copied to its own storage: the batch's bytes are its own rows, as after a transfer to a device,
    not the whole tensor they were cut from."""
    return map_tensors(batch, lambda t: t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size()
                       else t)


def _split(batch: Batch, sizes: Sequence[int]) -> list[Batch]:
    if isinstance(batch, torch.Tensor):
        # split_with_sizes: torch.split's own work, without its Python wrapper (once per tensor per step)
        return list(batch.split_with_sizes(list(sizes))) if batch.dim() > 0 else [batch] * len(sizes)
    if isinstance(batch, (list, tuple)):  # before the Mapping check: an ABC's isinstance is slow
        parts = [_split(v, sizes) for v in batch]
        if hasattr(batch, "_fields"):  # namedtuple
            return [type(batch)(*[p[i] for p in parts]) for i in range(len(sizes))]
        return [type(batch)([p[i] for p in parts]) for i in range(len(sizes))]
    if isinstance(batch, Mapping):
        parts = {k: _split(v, sizes) for k, v in batch.items()}
        return [like(batch, ((k, parts[k][i]) for k in batch)) for i in range(len(sizes))]
    return [batch] * len(sizes)  # non-tensor leaves (flags, names) go to every micro-batch


def split_batch(batch: Batch, sizes: Sequence[int], split_fn: SplitFn | None = None) -> list[Batch]:
    """Cut ``batch`` along dim 0 into consecutive micro-batches of ``sizes`` (views, no copies).

    Tensors, (named)tuples, lists and dicts nest freely; other leaves are shared by every part.
    Objects of other types need ``split_fn(batch, sizes) -> parts``.

    Raises:
        ValueError: ``sizes`` do not add up to the batch size, or ``split_fn`` returned a part count
            other than ``len(sizes)``.
    """
    if isinstance(batch, Samples):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [batch.take(range(start, start + size)) for start, size in zip(starts, sizes)]
    if split_fn is not None:
        parts = list(split_fn(batch, sizes))
        if len(parts) != len(sizes):
            raise ValueError(f"split_fn returned {len(parts)} parts for {len(sizes)} sizes {list(sizes)}")
        return parts
    total = batch_size(batch)
    if sum(sizes) != total or (len(sizes) > 0 and min(sizes) < 0):
        raise ValueError(f"micro-batch sizes {list(sizes)} must be >= 0 and add up to the batch size {total}")
    return _split(batch, sizes)


def describe_batch(batch: Batch) -> list[list[Any]]:
    """Shapes (without dim 0) and dtypes of a batch's tensors: what its memory per sample depends on."""
    return [[list(t.shape[1:]), str(t.dtype)] for t in tensors(batch)]
