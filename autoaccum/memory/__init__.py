"""Memory meters: the CUDA allocator's statistics, or live tensor bytes counted on any device.

A meter is entered around a region, ``reset_peak()`` starts a phase and ``peak_bytes`` reads its
peak. Bytes are absolute: everything the meter counts as live, not only the region's growth.
"""

from __future__ import annotations

from typing import Any, Protocol

import psutil
import torch

from autoaccum.memory.cuda import CudaMeter, DeviceCapacity, cuda_capacity
from autoaccum.memory.tracked import TrackedMemory, emulated_budget, iter_tensors

__all__ = [
    "CudaMeter", "DeviceCapacity", "MemoryMeter", "TrackedMemory",
    "device_capacity", "emulated_budget", "iter_tensors",
]


class MemoryMeter(Protocol):
    """What the probe needs of a meter."""

    kind: str

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> Any: ...
    def reset_peak(self) -> None: ...
    @property
    def peak_bytes(self) -> int: ...
    @property
    def current_bytes(self) -> int: ...
    def alloc_retries(self) -> int: ...


def device_capacity(device: torch.device) -> DeviceCapacity:
    """Total and available memory of ``device``: CUDA allocator + NVML, or host RAM (psutil)."""
    if device.type == "cuda":
        return cuda_capacity(device)
    vm = psutil.virtual_memory()
    return DeviceCapacity(total_bytes=int(vm.total), available_bytes=int(vm.available),
                          other_process_bytes=None, source="psutil")
