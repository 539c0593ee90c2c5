"""What several test files share: the relative difference of two sets of weights, a model's
parameters, a full-batch reference step, an injected OOM, the gloo skip, and padded token rows."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

#: a test that runs ranks of torch.distributed over gloo (skipped where this torch has none)
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_diff(a: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
             b: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> float:
    """``max |a - b| / max |b|`` over all tensors together (dicts by name, or lists in the same order).

    Together, not per tensor: per tensor it would be meaningless for a parameter whose gradient is zero
    in exact arithmetic (an attention key bias: softmax ignores a constant added to every key's
    score), which holds rounding noise of ~1e-23 on both sides."""
    if isinstance(a, Mapping):
        assert isinstance(b, Mapping) and a.keys() == b.keys(), "the two sets of weights name different tensors"
        pairs = [(a[k], b[k]) for k in a]
    else:
        assert len(a) == len(b), "the two sets of weights hold different numbers of tensors"
        pairs = list(zip(a, b))
    return max(float((x - y).abs().max()) for x, y in pairs) / max(float(y.abs().max()) for _, y in pairs)


def full_batch_steps(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batches: Iterable[Any],
                     optimizer: torch.optim.Optimizer) -> None:
    """The reference: one optimizer step per batch, the whole batch in one forward and backward."""
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        optimizer.step()


class InjectedOOM(torch.OutOfMemoryError):
    """An OOM raised on purpose: a real ``torch.OutOfMemoryError`` (the type the guard catches), and a
    subclass, so that a test can tell it from an emulated budget's."""


def pad_rows(rows: list[dict[str, torch.Tensor]], pad: int = 0) -> dict[str, torch.Tensor]:
    """Rows ``{"input_ids": 1-D tensor}`` right-padded to the longest, as a tokenizer's padding
    collator does: ``input_ids``, ``attention_mask`` and ``labels`` (the ids, -100 on padding)."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])], mask[i, :len(r["input_ids"])] = r["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def padded_token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy of a ``pad_rows`` batch, summed over its real tokens, and their
    count: the ``(loss_sum, num_items)`` form, normalised once per optimizer step."""
    logits = model(batch["input_ids"][:, :-1])
    targets = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, (targets != -100).sum()
