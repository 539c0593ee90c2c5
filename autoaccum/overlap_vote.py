"""One rank's vote to overlap a step's gradient all-reduce with the last backward (``OOMGuard(overlap=...)``).

The all-reduce of an overlapped step runs bucket by bucket during the last micro-batch's backward
(``autoaccum.distributed.overlap``); its buffers (the gradients' bytes) are memory the step then
holds on top of its peak. Each rank votes before the step (the guard gathers the votes with the
step's sample counts: one exchange, no gradient collective in flight); the step overlaps only where
every rank votes yes. A yes holds the buffers already, so that no rank can fail to allocate them
after the vote. ``overlap="auto"`` votes yes where the measured memory (``autoaccum.growth``)
predicts room for the step's peak plus the buffers within the usable limit, or where no limit can
be run into (CPU without an emulated budget).
"""

from __future__ import annotations

from typing import Literal

import torch

from autoaccum.growth import Growth
from autoaccum.memory import Meter, active_budget, usable_bytes
from autoaccum.regrow import memory_limit
from autoaccum.sync import OverlapSync
from autoaccum.units import format_bytes

__all__ = ["OverlapMode", "overlap_room", "overlap_vote"]

#: whether the gradient all-reduce may run during the last micro-batch's backward (see ``OOMGuard``)
OverlapMode = Literal["auto", "on", "off"]


def overlap_vote(sync: OverlapSync | None, params: list[torch.nn.Parameter], overlap: OverlapMode, attempt: int,
                 room: Growth, *, micro_batch: int, wait: int, device: torch.device,
                 meter: Meter, keep: bool = False) -> tuple[bool, str, bool]:
    """This rank's vote to overlap this attempt's all-reduce, why, and whether its buffers were
    allocated or given back just now (the step's start is then read again: they count there, never
    in its rise). ``sync``: the guard's sync where it is an :class:`~autoaccum.sync.OverlapSync`
    (the guard asks once: an ``isinstance`` against a runtime-checkable Protocol costs microseconds
    a step), else None. ``keep``: a chained
    attempt (``autoaccum.cut_agreement``), whose buckets every rank sends whatever it votes: the
    buffers stay held on a no (the rank then sits the attempt out)."""
    if overlap == "off" or sync is None:
        return False, "overlap='off'" if overlap == "off" else "this sync does not overlap", False
    extra = sync.overlap_bytes(params)
    if extra is None:
        return False, "this model's sync does not overlap (FSDP2: its reduce-scatter stays after the backward)", False
    if attempt > 1:
        vote, reason = False, "a replay after an OOM"
    elif overlap == "on":
        vote, reason = True, "overlap='on'"
    else:
        vote, reason = overlap_room(extra, room, micro_batch=micro_batch, wait=wait, device=device, meter=meter)
    if not vote:
        if keep:
            return False, reason, False
        sync.release_overlap(force=True)  # the guard's own vote: a chain it could hold is not used now
        return False, reason, extra == 0  # given back where they were held
    if not sync.prepare_overlap(params):
        return False, f"its buffers ({format_bytes(extra)}) do not fit now", False
    return True, reason, extra > 0


def overlap_room(extra_bytes: int, room: Growth, *, micro_batch: int, wait: int, device: torch.device,
                 meter: Meter) -> tuple[bool, str]:
    """overlap='auto': room for the step's predicted peak plus ``extra_bytes`` of buffers, and why."""
    if wait > 0:
        return False, f"an OOM struck an overlapped step; {wait} more clean step(s) first"
    start, limit = room.start, room.limit
    if start is None or limit is None:
        if device.type == "cpu" and memory_limit(meter) is None and active_budget() is None:
            return True, "no memory limit to run into (CPU without an emulated budget)"
        return False, "no memory model for this micro-batch yet (a meter that reads memory and its limit)"
    rise = room.predicted_rise(micro_batch)
    if rise is None:
        return False, f"no step measured yet at or below micro-batch {micro_batch}"
    predicted, usable = start.current_bytes + rise + extra_bytes, usable_bytes(limit, room.headroom)
    why = f"predicted peak {format_bytes(predicted)} (buffers {format_bytes(extra_bytes)} included), usable " \
          f"{format_bytes(usable)} (headroom {room.headroom:.0%})"
    return predicted <= usable, why
