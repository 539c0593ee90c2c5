"""What a probe measured and recommends: ``ProbeReport`` and its ``Candidate`` sizes.

Plain values, written as JSON (``autoaccum probe --json``, the probe cache) and read back.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from autoaccum.memory import usable_bytes
from autoaccum.memory.model import MemoryModel, TokenMemoryModel
from autoaccum.modules import unwrap
from autoaccum.plan.lengths import LengthProfile
from autoaccum.plan.plan import Plan
from autoaccum.plan.sources import read_plan_document

__all__ = ["Candidate", "ProbeReport", "REPORT_VERSION", "Status", "check_made_for", "model_fingerprint",
           "model_summary"]

REPORT_VERSION = 3
Status = Literal["ok", "over_budget", "oom"]


@dataclass(frozen=True)
class Candidate:
    """One probed micro-batch size.

    Attributes:
        micro_batch: samples per step.
        status: ``ok`` (fits under the usable budget), ``over_budget`` (ran, but its peak is
            above ``budget * (1 - headroom)``) or ``oom`` (ran out of memory).
        peak_bytes: the step's peak (max of the two phases); for ``oom`` the bytes it asked for.
        fwd_bwd_peak_bytes: the forward/backward pass's peak (None after an OOM).
        opt_peak_bytes: the optimizer step's peak (None after an OOM).
        step_time_s: a complete one-micro-batch training step: the fastest timed forward/backward
            pass plus the optimizer step (None after an OOM).
        micro_step_time_s: the fastest timed forward/backward pass alone (None after an OOM).
        length: the sequence length its samples were padded to (variable-length data), else None.
    """

    micro_batch: int
    status: Status
    peak_bytes: int | None
    fwd_bwd_peak_bytes: int | None = None
    opt_peak_bytes: int | None = None
    step_time_s: float | None = None
    micro_step_time_s: float | None = None
    length: int | None = None

    @property
    def samples_per_s(self) -> float | None:
        return None if not self.step_time_s else self.micro_batch / self.step_time_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_s": self.samples_per_s}

    def plan_step_time_s(self, share: int, min_micro_batch: int = 1, per_sample_s: float | None = None) -> float | None:
        """Seconds of one optimizer step of ``share`` samples cut at this size: its passes, then the
        optimizer step (None after an OOM).

        The plan cuts the share evenly, so its passes hold at most this many samples, and together
        exactly ``share``: each pass is this size's measured pass less ``per_sample_s`` for every
        sample the cut leaves out of it (default: the pass's time per sample, as if it had no fixed
        cost; the probe gives the slope of its timings). Timing every pass at the full size would
        charge a size that does not divide the share for samples it never runs (40 for 256: 7
        passes of 37, not of 40)."""
        if self.step_time_s is None:
            return None
        plan = Plan.for_target(share, self.micro_batch, 1, min_micro_batch)
        micro = self.micro_step_time_s if self.micro_step_time_s is not None else self.step_time_s
        slope = micro / self.micro_batch if per_sample_s is None else min(max(per_sample_s, 0.0),
                                                                          micro / self.micro_batch)
        left_out = plan.accum_steps * min(self.micro_batch, share) - share  # samples the cut leaves out
        return plan.accum_steps * micro - slope * max(left_out, 0) + (self.step_time_s - micro)


@dataclass(frozen=True)
class ProbeReport:
    """What the probe measured and what it recommends.

    Attributes:
        plan: the recommended plan for ``target_batch``.
        candidates: every size measured, in the order measured.
        model: the fitted memory model (None when fewer than two sizes ran).
        device: where it ran, e.g. ``cuda:0``.
        device_name: the GPU's name, or the device type.
        meter: how memory was read (``cuda``, ``tracked``, ``fake``).
        is_estimate: True when no real step ran (fake tensors): an estimate, not a measurement.
        budget_bytes: the budget planned for.
        budget_source: ``given``, or where the device's capacity was read.
        headroom: the fraction of the budget kept free.
        probe_steps: forward/backward passes run while probing (an OOM counts as one).
        probe_ooms: OOMs the probe triggered.
        wall_time_s: how long the probe took.
        fit_note: why the model was or was not trusted.
        optimizer_steps: optimizer steps run while probing.
        precision: ``fp32``, ``bf16`` or ``fp16``: the autocast (and GradScaler) every step ran under.
        token_model: for variable-length data, the memory model in (b, L) the token budget comes from.
        lengths: for variable-length data, the lengths planned for and where they were read.
        fingerprint: the hash the probe cache keys the report by.
        source: ``probe`` or ``cache``.
        torch_version: the torch that ran the probe.
        savers_tried: each memory saver on which the smallest micro-batch did not fit,
            with the bytes it needed, before the plan's saver (``plan.saver``): a lower bound, what the
            step reached before it ran out of memory.
        savers_weighed: each memory saver whose plan was timed against the others (the first saver the
            smallest micro-batch fits with, and each higher one while it stepped faster): the saver, its
            plan's micro-batch and that plan's measured step time (seconds; None where not timed). The plan
            is the fastest of them. Empty for an estimate, for variable-length data, and off CUDA where the step
            fits without a saver.
        model_fingerprint: a hash of the model measured (``model_fingerprint``): a run refuses the
            report for another model (``check_made_for``).
        model_summary: that model in words (``model_summary``).
    """

    plan: Plan
    candidates: tuple[Candidate, ...]
    model: MemoryModel | None
    device: str
    device_name: str
    meter: str
    is_estimate: bool
    budget_bytes: int
    budget_source: str
    headroom: float
    probe_steps: int
    probe_ooms: int
    wall_time_s: float
    fit_note: str
    precision: str = "fp32"
    optimizer_steps: int = 0
    token_model: TokenMemoryModel | None = None
    lengths: LengthProfile | None = None
    fingerprint: str = ""
    source: str = "probe"
    torch_version: str = field(default_factory=lambda: torch.__version__)
    savers_tried: tuple[tuple[str, int | None], ...] = ()
    savers_weighed: tuple[tuple[str, int, float | None], ...] = ()
    model_fingerprint: str = ""
    model_summary: str = ""

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.budget_bytes, self.headroom)

    @property
    def max_fitting_micro_batch(self) -> int:
        return max((c.micro_batch for c in self.candidates if c.status == "ok"), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION, "kind": "autoaccum.probe",
            "source": self.source, "fingerprint": self.fingerprint, "torch_version": self.torch_version,
            "device": self.device, "device_name": self.device_name, "meter": self.meter,
            "is_estimate": self.is_estimate, "budget_bytes": self.budget_bytes,
            "budget_source": self.budget_source, "headroom": self.headroom, "usable_bytes": self.usable_bytes,
            "candidates": [c.to_dict() for c in self.candidates],
            "model": None if self.model is None else self.model.to_dict(),
            "fit_note": self.fit_note, "plan": self.plan.to_dict(),
            "probe_steps": self.probe_steps, "optimizer_steps": self.optimizer_steps, "probe_ooms": self.probe_ooms,
            "wall_time_s": self.wall_time_s, "precision": self.precision,
            "token_model": None if self.token_model is None else self.token_model.to_dict(),
            "lengths": None if self.lengths is None else self.lengths.to_dict(),
            "savers_tried": [list(t) for t in self.savers_tried],
            "savers_weighed": [list(t) for t in self.savers_weighed],
            "model_fingerprint": self.model_fingerprint, "model_summary": self.model_summary,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeReport:
        """Rebuild a report from ``to_dict``'s output. Raises ValueError for anything else."""
        if not isinstance(data, dict) or data.get("kind") != "autoaccum.probe":
            raise ValueError("not an autoaccum probe report (missing kind 'autoaccum.probe')")
        if data.get("version") != REPORT_VERSION:
            raise ValueError(f"probe report version {data.get('version')!r} is not supported "
                             f"(expected {REPORT_VERSION})")
        try:
            fields = {"micro_batch", "status", "peak_bytes", "fwd_bwd_peak_bytes", "opt_peak_bytes", "step_time_s",
                      "micro_step_time_s", "length"}
            return cls(
                plan=Plan.from_dict(data["plan"]),
                candidates=tuple(Candidate(**{k: v for k, v in c.items() if k in fields}) for c in data["candidates"]),
                model=None if data["model"] is None else MemoryModel.from_dict(data["model"]),
                device=str(data["device"]), device_name=str(data["device_name"]), meter=str(data["meter"]),
                is_estimate=bool(data["is_estimate"]), budget_bytes=int(data["budget_bytes"]),
                budget_source=str(data["budget_source"]), headroom=float(data["headroom"]),
                probe_steps=int(data["probe_steps"]), probe_ooms=int(data["probe_ooms"]),
                wall_time_s=float(data["wall_time_s"]), fit_note=str(data["fit_note"]),
                precision=str(data["precision"]), optimizer_steps=int(data["optimizer_steps"]),
                token_model=(None if data.get("token_model") is None
                             else TokenMemoryModel.from_dict(data["token_model"])),
                lengths=None if data.get("lengths") is None else LengthProfile.from_dict(data["lengths"]),
                fingerprint=str(data["fingerprint"]), source=str(data["source"]),
                torch_version=str(data["torch_version"]),
                savers_tried=tuple((str(s), None if b is None else int(b)) for s, b in data["savers_tried"]),
                savers_weighed=tuple((str(s), int(b), None if t is None else float(t))
                                     for s, b, t in data["savers_weighed"]),
                model_fingerprint=str(data["model_fingerprint"]), model_summary=str(data["model_summary"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed probe report: {exc!r}") from None


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hash of what a plan for ``model`` depends on in the model itself: its class, and the name, shape,
    dtype and ``requires_grad`` of each parameter and buffer (the device is left out, and so are DDP and
    ``torch.compile`` wrappers: the same model probed on one device trains on another)."""
    inner = unwrap(model, compiled=True)
    key = {"model": type(inner).__qualname__,
           "params": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in inner.named_parameters()],
           "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in inner.named_buffers()]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def model_summary(model: torch.nn.Module) -> str:
    """``Sequential: 1,234 parameters (1,234 trainable), float32``."""
    inner = unwrap(model, compiled=True)
    params = list(inner.parameters())
    total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
    return f"{type(inner).__name__}: {total:,} parameters ({trainable:,} trainable), {'/'.join(dtypes)}"


def check_made_for(source: Any, model: torch.nn.Module, name: str = "plan") -> None:
    """Refuse a probe report or a search result (or its JSON file or dict) made for another model.

    A plan is made for one model: another one's memory per sample differs, and the report's memory model,
    which the guard grows back by after an OOM, would predict sizes that do not fit (or waste memory); a
    search's speeds were measured on it. A ``Plan`` carries no fingerprint and passes: it is the caller's
    explicit choice of a cut.

    Raises:
        ValueError: the fingerprint differs from ``model``'s, naming both models and the fixes.
    """
    try:
        document = read_plan_document(source)
    except (TypeError, ValueError):
        return  # unreadable: the plan reader says so where the plan is read
    measured, summary = document.model_fingerprint, document.model_summary
    noun = "search result" if document.kind == "autoaccum.search" or document.knobs is not None else "probe report"
    if not measured or measured == model_fingerprint(model):
        return
    where = f" ({source})" if isinstance(source, (str, os.PathLike)) else ""
    redo = f"Probe this model (drop {name}=)" if noun == "probe report" else \
        f"Search this model again (or drop {name}= to probe it)"
    raise ValueError(
        f"{name}= is a {noun}{where} measured on another model ({summary or 'its fingerprint differs'}) than "
        f"the one training ({model_summary(model)}); their parameters' names, shapes, dtypes or requires_grad "
        f"differ, and so does their memory: its plan and memory model do not hold here. {redo}, pass the "
        f"{noun} made for it, or, to keep that cut anyway, pass only its plan ({name}=its .plan, or "
        f"autoaccum.load_plan_file(path) for a file)")
