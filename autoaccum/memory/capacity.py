"""How much memory a device has, and the budget a plan is made for.

The usable part of a budget is ``budget * (1 - headroom)``: ``usable_bytes`` is the only
place that formula is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from autoaccum.memory.cuda import nvml_other_process_bytes
from autoaccum.units import parse_bytes
from autoaccum.validate import check_headroom

__all__ = ["Budget", "DeviceCapacity", "cuda_available_bytes", "cuda_capacity", "device_capacity", "resolve_budget",
           "usable_bytes"]


@dataclass(frozen=True)
class DeviceCapacity:
    """How much memory a device has and how much of it this process may use.

    Attributes:
        total_bytes: the device's (or host's) total memory.
        available_bytes: what this process can still use: free memory plus memory this process
            already holds in its allocator cache.
        other_process_bytes: memory held by other processes (NVML), None where unknown.
        source: where the numbers came from, e.g. ``"cuda+nvml"``, ``"psutil"``.
    """

    total_bytes: int
    available_bytes: int
    other_process_bytes: int | None
    source: str


def usable_bytes(budget_bytes: int, headroom: float) -> int:
    """The part of ``budget_bytes`` a plan may use: ``budget * (1 - headroom)``."""
    return int(budget_bytes * (1 - headroom))


@dataclass(frozen=True)
class Budget:
    """The memory a run plans for.

    Attributes:
        budget_bytes: the whole budget.
        headroom: the fraction kept free (fragmentation, other processes), in [0, 1).
        source: ``given`` (by the user), or where the device's capacity was read (``cuda+nvml``, ``psutil``).
    """

    budget_bytes: int
    headroom: float
    source: str

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.budget_bytes, self.headroom)


def cuda_available_bytes(device: torch.device) -> int:
    """What this process can still reach on a CUDA device: free memory plus what its allocator
    holds already (reusable by it, though the driver counts it as used), no more than the process
    may reserve under ``torch.cuda.set_per_process_memory_fraction`` (``fraction x total``: the
    allocator refuses past it, whatever is free). Two cheap queries, no NVML."""
    return _cuda_available(device)[0]


def _cuda_available(device: torch.device) -> tuple[int, int, float]:
    """(available bytes, total bytes, the per-process fraction where it caps them, else 1.0)."""
    free, total = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    # it takes an index: torch.device("cuda") has none (the current device is meant)
    index = device.index if device.index is not None else torch.cuda.current_device()
    fraction = float(get_fraction(index)) if get_fraction is not None else 1.0
    if fraction < 1.0 and fraction * total < available:
        return int(fraction * total), int(total), fraction
    return int(available), int(total), 1.0


def cuda_capacity(device: torch.device) -> DeviceCapacity:
    """Total memory of a CUDA device and what this process can still use of it
    (``cuda_available_bytes``), with NVML's count of memory held by other processes."""
    available, total, fraction = _cuda_available(device)
    others = nvml_other_process_bytes(device)
    source = "cuda+nvml" if others is not None else "cuda"
    if fraction < 1.0:
        source += f", per-process fraction {fraction:g}"
    return DeviceCapacity(total_bytes=total, available_bytes=available, other_process_bytes=others,
                          source=source)


def device_capacity(device: torch.device) -> DeviceCapacity:
    """Total and available memory of ``device``: CUDA allocator + NVML, or host RAM (psutil)."""
    if device.type == "cuda":
        return cuda_capacity(device)
    vm = psutil.virtual_memory()
    return DeviceCapacity(total_bytes=int(vm.total), available_bytes=int(vm.available),
                          other_process_bytes=None, source="psutil")


def resolve_budget(budget: int | str | None, device: torch.device, headroom: float) -> Budget:
    """The budget a run plans for: ``budget`` as given ("8GiB", bytes), or what ``device`` has free."""
    headroom = check_headroom(headroom)
    if budget is not None:
        return Budget(parse_bytes(budget), headroom, "given")
    capacity = device_capacity(device)
    return Budget(capacity.available_bytes, headroom, capacity.source)
