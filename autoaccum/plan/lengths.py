"""Sample lengths: where they come from, and the profile a plan for variable-length data is made for.

A sample's length is what its memory follows: the tokens of a sequence. By default it is read from
the sample itself -- the number of ones in its ``attention_mask``, or the length of its
``input_ids`` (a list or a 1-D tensor, as a tokenizer without padding returns them) -- or given
by ``length_fn(sample)``. A padded batch's rows are measured by their attention mask.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LengthFn", "LengthProfile", "checked_length_fn", "item_length", "row_lengths"]

LengthFn = Callable[[Any], int]


def item_length(item: Any) -> int:
    """The length of one sample: its attention mask's ones, or its ``input_ids``' length.

    Raises:
        TypeError: the sample has neither; pass ``length_fn=``.
    """
    if isinstance(item, Mapping):
        mask = item.get("attention_mask")
        if mask is not None:
            return int(torch.as_tensor(mask).sum())
        ids = item.get("input_ids")
        if ids is not None and (isinstance(ids, (list, tuple)) or (isinstance(ids, torch.Tensor) and ids.dim() == 1)):
            return len(ids)
    if isinstance(item, torch.Tensor) and item.dim() == 1:
        return int(item.shape[0])
    raise TypeError(f"cannot tell the length of a {type(item).__name__} sample: expected a dict with "
                    f"'attention_mask' or unpadded 'input_ids', or a 1-D tensor; pass length_fn=lambda sample: ...")


def row_lengths(batch: Mapping[str, Any]) -> list[int]:
    """The lengths of a padded dict batch's rows, from its ``attention_mask``.

    Raises:
        TypeError: the batch has no attention mask.
    """
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise TypeError("a padded batch is cut by length through its 'attention_mask' (rows x positions); this batch "
                        "has none. Give fit a dataset of unpadded samples and a collate_fn, or length_fn=")
    return [int(n) for n in mask.sum(dim=1).tolist()]


@dataclass(frozen=True)
class LengthProfile:
    """The lengths a plan is made for: the shortest, the median and the longest, and where they came from.

    Attributes:
        shortest: the shortest length read.
        median: the median length read (the lower of the two middle ones for an even count).
        longest: the longest length read.
        count: how many lengths were read.
        total: how many samples the data holds (None: unknown).
        source: in words, e.g. ``all 1,000 samples``, ``1,000 of 50,000 samples (evenly spaced)``.
    """

    shortest: int
    median: int
    longest: int
    count: int
    total: int | None
    source: str

    @classmethod
    def of(cls, lengths: Sequence[int], total: int | None = None, source: str = "") -> LengthProfile:
        if not lengths:
            raise ValueError("no lengths to plan for: the data is empty")
        ordered = sorted(int(n) for n in lengths)
        if ordered[0] < 1:
            raise ValueError(f"a sample of length {ordered[0]}: every sample needs at least one token")
        return cls(ordered[0], int(statistics.median_low(ordered)), ordered[-1], len(ordered), total,
                   source or f"all {len(ordered):,} samples")

    @property
    def varies(self) -> bool:
        return self.longest > self.shortest

    def probe_lengths(self) -> tuple[int, ...]:
        """The lengths the probe measures at: the longest first, then the shortest and the median."""
        return tuple(dict.fromkeys((self.longest, self.shortest, self.median)))

    def to_dict(self) -> dict[str, Any]:
        return {"shortest": self.shortest, "median": self.median, "longest": self.longest, "count": self.count,
                "total": self.total, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> LengthProfile:
        return cls(int(data["shortest"]), int(data["median"]), int(data["longest"]), int(data["count"]),
                   None if data.get("total") is None else int(data["total"]), str(data["source"]))


def checked_length_fn(length_fn: Callable[[Any], Any]) -> Callable[[Any], int]:
    """``length_fn`` with each length it returns checked: an int >= 1 (a sample's tokens), as an int.

    Raises:
        TypeError: ``length_fn`` is not callable.
        ValueError: a length that is not an int >= 1, naming it and the sample.
    """
    if not callable(length_fn):
        raise TypeError(f"length_fn must be a function of one sample returning its length, got {length_fn!r}")

    def length(item: Any) -> int:
        value = length_fn(item)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, bool) and hasattr(value, "__index__"):  # an int, or numpy's
            value = value.__index__()
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            shown = type(item).__name__ if not isinstance(item, torch.Tensor) else f"tensor of shape {list(item.shape)}"
            raise ValueError(f"length_fn returned {value!r} for a sample (a {shown}): it must return the sample's "
                             f"length, an int >= 1 (its tokens, e.g. length_fn=len or lambda s: len(s['input_ids']))")
        return value

    return length
