"""Memory: meters that read it, the capacity of a device, and the budget a plan is made for.

This package is the only place autoaccum reads memory. A meter (``Meter``) is entered around
a region; ``reset_peak()`` starts a phase and ``read()`` returns the live bytes and their peak.
Bytes are absolute: everything the meter counts as live, not only the region's growth.
"""

from __future__ import annotations

import torch

from autoaccum.memory.capacity import (
    Budget,
    DeviceCapacity,
    cuda_available_bytes,
    cuda_capacity,
    device_capacity,
    resolve_budget,
    usable_bytes,
)
from autoaccum.memory.cuda import CudaMeter
from autoaccum.memory.meter import MemoryReading, Meter, NullMeter
from autoaccum.memory.tracked import (
    TrackedMemory,
    active_budget,
    emulated_budget,
    emulated_device,
    iter_tensors,
    refuse_compiled,
    refuse_two_budgets,
)

__all__ = [
    "Budget", "CudaMeter", "active_budget", "DeviceCapacity", "MemoryReading", "Meter", "NullMeter", "TrackedMemory",
    "cuda_available_bytes", "cuda_capacity", "default_meter", "device_capacity", "emulated_budget", "emulated_device",
    "iter_tensors", "refuse_compiled", "refuse_two_budgets", "resolve_budget", "usable_bytes",
]


def default_meter(device: torch.device) -> CudaMeter | NullMeter:
    """The meter that reads ``device`` without changing how it runs: the CUDA allocator, or nothing."""
    return CudaMeter(device) if device.type == "cuda" else NullMeter()
