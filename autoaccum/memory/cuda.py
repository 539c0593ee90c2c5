"""What the CUDA caching allocator and NVML report. Nothing here initialises CUDA at import."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["CudaMeter", "DeviceCapacity", "cuda_capacity", "nvml_other_process_bytes"]

logger = logging.getLogger(__name__)


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


class CudaMeter:
    """Peak and current allocated bytes from the CUDA caching allocator of one device."""

    kind = "cuda"

    def __init__(self, device: torch.device | str | int) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaMeter needs a cuda device, got {self.device}")

    def __enter__(self) -> CudaMeter:
        torch.cuda.synchronize(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    @property
    def peak_reserved_bytes(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    @property
    def current_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def alloc_retries(self) -> int:
        """How often the allocator had to free its cache and retry (rising = thrashing)."""
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))


@lru_cache(maxsize=1)
def _nvml():
    """The initialised pynvml module, or None where there is no driver (normal on CPU hosts)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception as exc:  # no library, no driver, no permission: all mean "no NVML here"
        logger.debug("NVML unavailable: %s", exc)
        return None


def nvml_other_process_bytes(device: torch.device) -> int | None:
    """Bytes held on ``device`` by processes other than this one, or None when NVML can't say."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = torch.cuda.get_device_properties(index).uuid
        handle = None
        for i in range(nvml.nvmlDeviceGetCount()):  # CUDA and NVML can number devices differently
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            if str(uuid) in str(nvml.nvmlDeviceGetUUID(h)):
                handle = h
                break
        if handle is None:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        procs = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        return sum(int(p.usedGpuMemory or 0) for p in procs if p.pid != os.getpid())
    except Exception as exc:
        logger.debug("NVML query failed: %s", exc)
        return None


def cuda_capacity(device: torch.device) -> DeviceCapacity:
    """Total memory of a CUDA device and what this process can still use of it."""
    free, total = torch.cuda.mem_get_info(device)
    # Memory cached by our own allocator is reusable by us, though the driver counts it as used.
    reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    others = nvml_other_process_bytes(device)
    return DeviceCapacity(
        total_bytes=int(total),
        available_bytes=int(free + reusable + torch.cuda.memory_allocated(device)),
        other_process_bytes=others,
        source="cuda+nvml" if others is not None else "cuda",
    )
