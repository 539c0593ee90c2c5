"""What the systems share: recording losses, the data as a Dataset, the finder's cost, and how the
integrations' probe (inside their first step) is accounted."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..context import RunResult
from ..recorder import Recorder
from ..workloads import Batch, loss_sum, on_device, slice_batch


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


class GlobalRows(Rows):
    """The data for the integrations' loaders, which yield global batches: a run of consecutive indices
    comes back as views of the data -- host memory, which the emulated device does not count, as the
    autoaccum row's slices -- and the loss copies each micro-batch (``on_device``), as the peers pay
    for their collated micro-batches. (HF's Trainer under autoaccum keeps global batches in host memory
    too; Lightning and a default Accelerate loader would put them on a GPU whole.)"""

    def __getitems__(self, indices: list[int]) -> Batch:
        start = indices[0] if indices else 0
        if list(indices) == list(range(start, start + len(indices))):
            return slice_batch(self.data, start, start + len(indices))
        return super().__getitems__(indices)


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


def pair_loss(recorder: Recorder,
              device: torch.device) -> Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]]:
    """``(loss_sum, count)`` of a micro-batch, recording its sample ids: what autoaccum's loss_fn takes
    (token-exact: the step is divided once by all its items). On CPU the micro-batch is copied, as the
    peers' loaders copy theirs (a slice of the data is a view and would cost the emulated device nothing)."""
    def loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        recorder.forward(batch)
        return loss_sum(model, batch if device.type == "cuda" else on_device(batch, device))
    return loss


def record_probe(lazy: Any, recorder: Recorder, result: RunResult) -> None:
    """Account an integration's probe (run inside its first training step) as the finding phase: its
    optimizer steps are not training steps, its cost is the row's *find* cost, and training starts after it."""
    build = lazy.build

    def recorded_build(batch: Batch, loss_fn: Callable[..., Any]) -> Any:
        if lazy.guard is not None:
            return lazy.guard
        recorder.phase = "find"
        guard = build(batch, loss_fn)
        report = lazy.report
        if report is not None:
            result.find_steps, result.find_time_s, result.find_ooms = report.probe_steps, report.wall_time_s, \
                report.probe_ooms
            result.planned_micro = report.plan.micro_batch
            result.notes.append(f"probe at the first global batch: micro-batches up to "
                                f"{report.max_fitting_micro_batch} fit; plan {report.plan.describe()}")
        recorder.phase = "train"
        recorder.new_attempt()
        return guard

    lazy.build = recorded_build


def guard_outcome(lazy: Any, result: RunResult) -> None:
    """The final plan and the OOMs the guard replayed in training."""
    guard = lazy.guard if lazy is not None else None
    if guard is None:
        return
    result.micro_batch, result.train_ooms, result.saver = guard.plan.micro_batch, guard.ooms, guard.plan.saver
    result.notes.append(f"final {guard.plan.describe()}")
    result.notes.extend(f"plan change: {c.describe()}" for c in guard.changes)
