"""The one interface through which autoaccum reads memory: a ``Meter``.

The probe, the guard and the throughput measurement read memory only through a meter, so that
every reading comes from ``autoaccum.memory``: the CUDA allocator (``CudaMeter``), the
tracked counter (``TrackedMemory``, which can also enforce an emulated budget), or nothing
(``NullMeter``, on a device no meter can read, e.g. the CPU without a budget).

Bytes are absolute: everything the meter counts as live, not only a region's growth.
``Meter.read`` is cheap (one allocator query on CUDA, attribute reads for the counter, no
device synchronisation), so the guard reads it once at the start and once at the end of a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Meter", "MemoryReading", "NullMeter"]


@dataclass(frozen=True)
class MemoryReading:
    """One reading of a meter.

    Attributes:
        current_bytes: bytes live now.
        peak_bytes: the peak since the last ``reset_peak()``.
        alloc_retries: how often the CUDA allocator freed its cache and retried (rising from step
            to step = thrashing); None where there is no such allocator.
    """

    current_bytes: int
    peak_bytes: int
    alloc_retries: int | None = None


class Meter(Protocol):
    """What the probe, the guard and the throughput measurement need of a meter.

    Attributes:
        kind: ``cuda``, ``tracked`` or ``none``.
        budget_bytes: the memory the run has (an emulated budget, or the device's), None if unknown.
        last_oom_needed_bytes: at the last OOM, the bytes in use plus the allocation that failed
            (a lower bound on what the step needed), None if unknown.
    """

    kind: str

    @property
    def budget_bytes(self) -> int | None: ...
    @property
    def last_oom_needed_bytes(self) -> int | None: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> Any: ...
    def reset_peak(self) -> None: ...
    def read(self) -> MemoryReading | None: ...


class NullMeter:
    """A meter for a device nobody can read: every reading is None."""

    kind = "none"
    budget_bytes = None
    last_oom_needed_bytes = None

    def __enter__(self) -> NullMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def reset_peak(self) -> None:
        return None

    def read(self) -> MemoryReading | None:
        return None
