"""What one system's run gets (``Context``) and gives back (``RunResult``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .recorder import Recorder
from .workloads import Batch, Workload


@dataclass
class Context:
    workload: Workload
    data: Batch
    base: nn.Module
    budget_bytes: int
    steps: int
    device: torch.device
    truly_fits: int
    drop: tuple[int, int] | None = None  # (after this many steps, new budget bytes)


@dataclass
class RunResult:
    micro_batch: int | None = None  # in force at the end
    planned_micro: int | None = None  # what the finder chose, where it differs
    find_steps: int | None = None
    find_time_s: float | None = None
    find_ooms: int | None = None
    train_ooms: int = 0
    budget_ooms: int = 0  # every OOM the run's budget raised, caught or not (not the probe's own counter's)
    saver: str | None = None  # the memory saver autoaccum trained on (``autoaccum.memory.savers``)
    planned_saver: str | None = None  # the one the finder chose, where it differs
    weighed: list[tuple[str, int, float | None]] = field(default_factory=list)  # the probe's savers_weighed
    error: str | None = None
    model: nn.Module | None = None
    notes: list[str] = field(default_factory=list)
    recorder: Recorder | None = None
    wall_s: float = 0.0
