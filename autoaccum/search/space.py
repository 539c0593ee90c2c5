"""The search space: which micro-batches and knobs a search may try.

Micro-batches come from the probe's memory model: for every accumulation count ``k`` the balanced
size ``ceil(share / k)`` (fewest passes, lowest peak for that ``k``; 86 for a share of 256 in 3
passes, not only powers of two), the powers of two and the multiples of 8, up to the largest size
predicted to fit -- and up to ``beyond_fit`` times that when a memory-saving knob (a memory saver above ``none``,
bf16/fp16) is searched, since those sizes may fit with it. The study samples the sizes as an ordered index
(``micro_batch_index``), so TPE can learn which region is fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from autoaccum.probe.report import ProbeReport
from autoaccum.search.knobs import Knobs, available_knobs
from autoaccum.validate import check_positive_float, check_positive_int

__all__ = ["KNOBS", "SearchSpace", "accumulated_fit", "candidate_micro_batches", "resolve_space"]

#: the knobs a trial sets, in the order of ``Knobs``
KNOBS = ("saver", "autocast", "compile")


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose. ``None``: the default for the model and device.

    Attributes:
        micro_batches: sizes to try (default: from the probe's memory model, see the module docstring).
        saver: memory savers, e.g. ``("none", "checkpointing")`` (default: the memory savers for the model and device,
            ``autoaccum.memory.savers.allowed_savers``; ``offload`` on CUDA).
        autocast: among ``fp32``, ``bf16``, ``fp16`` (default: what the device supports).
        compile: e.g. ``(False, True)`` (default: on CUDA only; compiling on CPU is slow).
        beyond_fit: with a memory-saving knob in the space, sizes up to this multiple of the
            largest that fits without knobs are tried too.
    """

    micro_batches: tuple[int, ...] | None = None
    saver: tuple[str, ...] | None = None
    autocast: tuple[str, ...] | None = None
    compile: tuple[bool, ...] | None = None
    beyond_fit: float = 4.0

    def __post_init__(self) -> None:
        if self.micro_batches is not None:
            if not self.micro_batches:
                raise ValueError("SearchSpace.micro_batches is empty; give at least one size, or None for the default")
            for b in self.micro_batches:
                check_positive_int(b, "SearchSpace.micro_batches entry")
        for name in KNOBS:
            values = getattr(self, name)
            if values is not None:
                if not values:
                    raise ValueError(f"SearchSpace.{name} is empty; give at least one value, or None for the default")
                for v in values:
                    Knobs(**{name: v})  # validates the value
        check_positive_float(self.beyond_fit, "beyond_fit", minimum=1, inclusive=True)


def candidate_micro_batches(share: int, fit: int, beyond: int | None = None) -> tuple[int, ...]:
    """The sizes worth a trial, up to ``fit`` (or ``beyond``, when larger), capped at ``share``:
    the balanced size ``ceil(share / k)`` of every accumulation count ``k`` (the fewest passes
    and lowest peak for that ``k``), the powers of two, and the multiples of 8 (aligned GEMM
    shapes where the batch is a matrix dimension)."""
    top = max(1, min(share, max(fit, beyond or 0)))
    sizes = {math.ceil(share / k) for k in range(1, share + 1)} | {2**i for i in range(top.bit_length())} | \
        set(range(8, top + 1, 8))
    return tuple(sorted(s for s in sizes if s <= top))


def resolve_space(space: SearchSpace, report: ProbeReport, model: torch.nn.Module, device: torch.device,
                  share: int) -> dict[str, Any]:
    """The concrete space: the list of micro-batches and the values of each knob (JSON: a study
    keeps it in its user attributes, so that a resumed study samples the same sizes)."""
    defaults = available_knobs(model, device)
    knobs = {name: tuple(getattr(space, name) or defaults[name]) for name in KNOBS}
    unavailable = [r for r in knobs["saver"] if r not in defaults["saver"]]
    if unavailable:
        raise ValueError(f"saver {unavailable} cannot be applied to {type(model).__name__} on {device.type}: its "
                         f"memory savers is {defaults['saver']} (checkpointing needs an nn.ModuleList of blocks or a "
                         f"gradient_checkpointing_enable(); offload needs CUDA). Leave it out of the space.")
    if space.micro_batches is not None:
        sizes = tuple(sorted({min(b, share) for b in space.micro_batches}))
    else:
        ok = report.max_fitting_micro_batch
        failed = min((c.micro_batch for c in report.candidates if c.status != "ok"), default=share + 1)
        predicted = report.model.max_batch(report.budget_bytes, report.headroom) if report.model is not None else 0
        fit = max(ok, min(predicted, failed - 1))
        saving = any(r != "none" for r in knobs["saver"]) or any(a != "fp32" for a in knobs["autocast"])
        sizes = candidate_micro_batches(share, fit, int(fit * space.beyond_fit) if saving else None)
    return {"micro_batches": list(sizes), **{k: list(v) for k, v in knobs.items()}}


def accumulated_fit(report: ProbeReport, share: int, grad_bytes: int) -> int:
    """The largest micro-batch predicted to fit as an *accumulated* step (the study's seeds go up to
    it): the share where the model predicts it fits in one pass; below it, the room the memory
    model leaves under the usable budget less ``grad_bytes`` (the summed gradients an accumulated
    step holds while later micro-batches run), over the model's bytes per sample."""
    model = report.model
    if model is None:
        return max(report.max_fitting_micro_batch, 1)
    if model.max_batch(report.budget_bytes, report.headroom) >= share:
        return share  # one pass: no accumulation, the probe's reading applies as it is
    if model.per_sample_bytes <= 0:
        return share
    room = report.usable_bytes - model.base_bytes - grad_bytes
    return int(min(share, max(1, room // model.per_sample_bytes)))
