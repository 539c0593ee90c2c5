"""Probe results kept on disk as JSON, keyed by a fingerprint of everything the memory depends on.

Files are written atomically (``autoaccum.jsonio``). A file that is corrupt, of another version or
of another fingerprint is ignored with a warning: never trusted blindly, never unpickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from autoaccum.jsonio import write_json_atomic
from autoaccum.log import rank_level, user_stacklevel
from autoaccum.plan.batch import describe_batch
from autoaccum.plan.task import Task
from autoaccum.probe.report import ProbeReport
from autoaccum.units import format_bytes

__all__ = ["default_cache_dir", "describe_optimizer", "fingerprint", "load", "store"]

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/autoaccum`` (``~/.cache/autoaccum`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autoaccum"


def fingerprint(task: Task, optimizer: Any, *, device: torch.device, capacity_bytes: int, budget_bytes: int,
                headroom: float, target_batch: int, world_size: int, upper: int, estimate: bool,
                precision: str = "fp32", lengths: Any = None, savers: Any = ("none",)) -> str:
    """A hash of what a probe's result depends on: parameter and buffer shapes and dtypes, the
    sample's shapes, the optimizer, the device and its capacity, torch, the budget and the target."""
    key = {
        "params": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in task.model.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in task.model.named_buffers()],
        "model": type(task.model).__qualname__,
        "sample": describe_batch(task.batch(1)),
        "optimizer": describe_optimizer(optimizer, task),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "capacity_bytes": capacity_bytes if device.type == "cuda" else None,  # host RAM varies run to run
        "torch": torch.__version__,
        "budget_bytes": budget_bytes, "headroom": headroom, "target_batch": target_batch,
        "world_size": world_size, "upper": upper, "estimate": estimate, "precision": precision,
        "lengths": lengths, "savers": list(savers),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def describe_optimizer(optimizer: Any, task: Task) -> dict[str, Any]:
    """What the optimizer's memory depends on: its class and the options of each parameter group
    (``foreach``, ``fused``, ``amsgrad``, momentum ... and the lr, which is what tells two factories
    apart when nothing else does).

    For a factory (``task.make_optimizer``) it is what the factory builds on the model's trainable
    parameters, as the probe will build it: two lambdas share a ``__qualname__`` (``<lambda>``), so
    the name alone would not tell ``lambda p: SGD(p, lr=0.1)`` from ``lambda p: AdamW(p)``. Building
    a torch optimizer allocates no state (that comes with the first ``step()``). A factory that
    cannot be built here is described by its code's location instead (the probe will report why).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        factory = task.make_optimizer
        try:
            optimizer = factory([p for p in task.model.parameters() if p.requires_grad])
        except Exception:  # noqa: BLE001 - a description only; the probe raises the factory's error itself
            optimizer = None
        if not isinstance(optimizer, torch.optim.Optimizer):
            code = getattr(factory, "__code__", None)
            return {"factory": getattr(factory, "__qualname__", type(factory).__name__),
                    "code": None if code is None else f"{code.co_filename}:{code.co_firstlineno}"}
    kind = type(optimizer)
    return {"class": f"{kind.__module__}.{kind.__qualname__}",
            "groups": [{"params": len(group["params"]),
                        **{k: repr(v) for k, v in sorted(group.items()) if k != "params"}}
                       for group in optimizer.param_groups]}


def _path(fp: str, cache_dir: str | os.PathLike | None) -> Path:
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return folder / f"probe-{fp[:24]}.json"


def store(report: ProbeReport, cache_dir: str | os.PathLike | None = None) -> ProbeReport:
    """Save ``report`` under its fingerprint; returns it. A failure to write only warns."""
    path = _path(report.fingerprint, cache_dir)
    try:
        write_json_atomic(path, report.to_dict())
    except OSError as exc:
        warnings.warn(f"could not write the probe cache {path}: {exc}; the result is not cached",
                      stacklevel=user_stacklevel())
    return report


def load(fp: str, cache_dir: str | os.PathLike | None = None) -> ProbeReport | None:
    """The cached report for fingerprint ``fp``, or None (missing, corrupt, or not ours: warned)."""
    path = _path(fp, cache_dir)
    if not path.exists():
        return None
    # a file the user may have edited is replaced, and saying so is the least: how to keep it instead
    replaced = ("; the probe measures again and its result replaces the file (to keep the file, move it away, or "
                "probe with cache=False, --no-cache on the command line, which neither reads nor writes the cache)")
    try:
        report = ProbeReport.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:  # (not UTF-8 and not JSON are ValueErrors too)
        warnings.warn(f"ignoring probe cache {path}: {exc}{replaced}", stacklevel=user_stacklevel())
        return None
    if report.fingerprint != fp:
        warnings.warn(f"ignoring probe cache {path}: it was written for another task or device{replaced}",
                      stacklevel=user_stacklevel())
        return None
    over = next((c for c in report.candidates if c.status == "ok" and c.peak_bytes is not None
                 and c.peak_bytes > report.usable_bytes), None)
    if over is not None:  # a measurement cannot say so: the file was edited
        warnings.warn(f"ignoring probe cache {path}: micro-batch {over.micro_batch} is marked as fitting with a peak "
                      f"of {format_bytes(over.peak_bytes)}, above the {format_bytes(report.usable_bytes)} usable "
                      f"(not a probe's result){replaced}", stacklevel=user_stacklevel())
        return None
    logger.log(rank_level(logging.INFO), "probe: reusing the result measured earlier for this model, device and "
               "budget (%s)", path)
    return dataclasses.replace(report, source="cache")
