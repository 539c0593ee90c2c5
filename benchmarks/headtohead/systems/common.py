"""What the systems share: a recording mean loss, the data as a Dataset, and the finder's cost."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..context import RunResult
from ..recorder import Recorder
from ..workloads import Batch, loss_sum


def mean_loss(recorder: Recorder) -> Callable[[nn.Module, Batch], torch.Tensor]:
    """The mean loss of a micro-batch (what the peers' APIs take), recording its sample ids."""
    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        recorder.forward(batch)
        total, count = loss_sum(model, batch)
        return total / count
    return loss


class Rows(torch.utils.data.Dataset):
    """The data as a map-style dataset for the peers' DataLoaders, fetched a batch at a time.

    ``__getitems__`` (torch >= 2.0) gathers a whole micro-batch with one index per tensor, and
    :func:`batched` passes it through, so the peers pay one copy per micro-batch (as autoaccum and the
    hand loop do) instead of the per-sample Python of ``default_collate`` over dict rows."""

    def __init__(self, data: Batch) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data["ids"])

    def __getitem__(self, i: int) -> Batch:
        return {k: v[i] for k, v in self.data.items()}

    def __getitems__(self, indices: list[int]) -> Batch:
        index = torch.as_tensor(indices)
        return {k: v[index] for k, v in self.data.items()}


def batched(batch: Batch) -> Batch:
    """The collate function for :class:`Rows`: the batch is already gathered."""
    return batch


def finder_cost(result: RunResult, recorder: Recorder, budget: Any) -> None:
    """For peers whose finder IS the training run: everything before the final attempt, plus the OOMs
    of the final attempt's first step."""
    final_start = recorder.attempt_starts[-1] if recorder.attempt_starts else time.perf_counter()
    earlier = [s for s in recorder.steps if s.attempt < recorder.attempt]
    failed_attempts = max(recorder.attempt - 1, 0)
    result.find_steps = len(earlier) + failed_attempts  # completed steps of abandoned runs + each failing one
    result.find_time_s = final_start - (recorder.attempt_starts[0] if recorder.attempt_starts else final_start)
    result.find_ooms = sum(1 for t in budget.oom_times if t < final_start) if budget.oom_times else failed_attempts
