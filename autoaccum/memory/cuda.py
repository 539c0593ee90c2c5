"""What the CUDA caching allocator and NVML report. Nothing here initialises CUDA at import.

The allocator's statistics are host-side bookkeeping (a block is counted when an op is launched and
released when its tensor dies), so reading them needs no device synchronisation."""

from __future__ import annotations

import logging
import os
from functools import lru_cache

import torch

from autoaccum.memory.meter import MemoryReading

__all__ = ["CudaMeter", "nvml_other_process_bytes"]

logger = logging.getLogger(__name__)


class CudaMeter:
    """Peak and current allocated bytes from the CUDA caching allocator of one device (a ``Meter``).

    Args:
        device: the CUDA device.
        budget_bytes: the budget the run plans for, if known; default: the device's total memory.
    """

    kind = "cuda"

    def __init__(self, device: torch.device | str | int, budget_bytes: int | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaMeter needs a cuda device, got {self.device}")
        self._budget_bytes = budget_bytes

    def __enter__(self) -> CudaMeter:
        torch.cuda.synchronize(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)

    @property
    def budget_bytes(self) -> int:
        if self._budget_bytes is not None:
            return self._budget_bytes
        return int(torch.cuda.mem_get_info(self.device)[1])

    @property
    def last_oom_needed_bytes(self) -> int:
        """A lower bound on what the failed step needed: the allocator's peak (the failed request is not in it)."""
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> MemoryReading:
        # One query, in the nested form: torch.cuda.memory_stats() flattens the same dict in Python on every call.
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        allocated = stats["allocated_bytes"]["all"]
        return MemoryReading(int(allocated["current"]), int(allocated["peak"]), int(stats.get("num_alloc_retries", 0)))

    @property
    def peak_bytes(self) -> int:
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
