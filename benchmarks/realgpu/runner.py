"""One model's parts in order, each saved to ``<out>/<model>.json`` as soon as it is done (resumable).

A rerun keeps the parts already measured (a part that raised keeps its error; ``--redo`` measures
everything again) and runs the rest; a part that cannot run here is recorded as skipped with its reason
and looked at again next time. A file written under other settings is not reused.
"""

from __future__ import annotations

import gc
import json
import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autoaccum.jsonio import write_json_atomic

from . import parts
from .models import Built, Workload, build, missing_dependency
from .squeeze import SQUEEZES, release, skip_reason

__all__ = ["PARTS", "run_model"]

logger = logging.getLogger("real_gpu")

KIND, VERSION = "autoaccum.bench.real_gpu.model", 1
PARTS = ("estimate", *(f"squeeze:{k}" for k in SQUEEZES), "sweep", "search")


def parts_of(settings: parts.Settings) -> tuple[str, ...]:
    """The parts a model's row measures, in order."""
    if settings.rows == "issue40":
        return (*(f"squeeze:{k}" for k in settings.squeezes), "estimate", "sweep")
    return PARTS


def _header(w: Workload, device: torch.device, settings: parts.Settings, size: str) -> dict[str, Any]:
    return {"kind": KIND, "version": VERSION, "model": w.name, "size": size, "device_type": device.type,
            "settings": settings.to_dict()}


def _load(path: Path, header: dict[str, Any], redo: bool) -> dict[str, Any]:
    """The saved document when it was made under the same header, else a new one."""
    if path.exists() and not redo:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("%s: unreadable (%s); measuring again", path, exc)
        else:
            if all(doc.get(k) == v for k, v in header.items()):
                return doc
            logger.warning("%s was written under other settings; measuring again", path)
    return {**header, "parts": {}}


def _why_not(part: str, doc: dict[str, Any], device: torch.device, search: bool,
             settings: parts.Settings | None = None) -> str | None:
    """Why ``part`` cannot run now, or None."""
    if part.startswith("squeeze:"):
        return skip_reason(part.split(":", 1)[1], device)  # type: ignore[arg-type]
    if part == "sweep":
        measured = [p for k, p in doc["parts"].items() if k.startswith("squeeze:") and "brute_force" in p]
        return None if measured else "skipped: no squeeze was measured"
    if part == "search":
        if not search:
            return "skipped: --no-search"
        try:
            import optuna
        except ImportError:
            return "skipped: optuna is not installed (pip install 'autoaccum[search]')"
        budget = doc["parts"].get("squeeze:budget", {})
        if "plan" not in budget.get("probe", {}):
            return "skipped: squeeze (iii) has no probe report to search from"
    return None


def _run_part(part: str, built: Built, device: torch.device, settings: parts.Settings,
              doc: dict[str, Any]) -> dict[str, Any]:
    if part == "estimate":
        return parts.estimate(built, device, settings)
    if part.startswith("squeeze:"):
        return parts.squeezed(built, part.split(":", 1)[1], device, settings)  # type: ignore[arg-type]
    squeezes = {k.split(":", 1)[1]: p for k, p in doc["parts"].items() if k.startswith("squeeze:")
                and "brute_force" in p}
    if part == "sweep":
        return parts.sweep(built, device, squeezes, settings)
    return parts.search(built, device, squeezes["budget"], settings)


def _measured(part: str, built: Built, device: torch.device, settings: parts.Settings,
              doc: dict[str, Any]) -> dict[str, Any]:
    """``part``'s result, or the error it raised (a part that crashes is a finding: kept, and the row goes on)."""
    started = time.perf_counter()
    try:
        result = _run_part(part, built, device, settings, doc)
    except Exception as exc:
        logger.error("%s %s failed:\n%s", built.workload.name, part, traceback.format_exc())
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
    if "error" in result:  # outside the except block: what the failed part held is unreachable now
        release(device)
    result["wall_s"] = time.perf_counter() - started
    result["device_name"] = doc["device_name"]  # a model resumed on another card says so (report)
    return result


def run_model(w: Workload, device: torch.device, settings: parts.Settings, size: str, out: Path, *,
              redo: bool = False, search: bool = True, measure: bool = True,
              log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure what is missing of ``w``'s parts (``measure=False``: nothing, only read what is saved);
    returns the model's document (also saved under ``out``)."""
    path = out / f"{w.name}.json"
    doc = _load(path, _header(w, device, settings, size), redo)
    missing = missing_dependency(w) if measure else None
    names = parts_of(settings)
    if missing is not None:
        doc["parts"] = {p: {"skipped": f"skipped: {missing}"} for p in names}
    if not measure or missing is not None:
        return doc
    built: Built | None = None
    for part in (p for p in names if p not in doc["parts"] or "skipped" in doc["parts"][p]):
        reason = _why_not(part, doc, device, search, settings)
        if reason is not None:
            doc["parts"][part] = {"skipped": reason}
            log(f"{w.name} {part}: {reason}")
            continue
        if built is None:
            started = time.perf_counter()
            built = build(w, device)
            doc["build_s"] = time.perf_counter() - started
        doc.update(describe=w.describe, params=built.params, target_batch=w.target_batch,
                   budget_bytes=w.budget_bytes, smallest=built.smallest,
                   device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        # Trials and failed tries release memory with a full collection: what lives on (the imports, the host
        # model) is frozen first, so that a collection does not walk it every time (0.1-0.6 s each else).
        gc.collect()
        gc.freeze()
        try:
            doc["parts"][part] = result = _measured(part, built, device, settings, doc)
        finally:
            gc.unfreeze()
        write_json_atomic(path, doc)
        log(f"{w.name} {part}: {'error: ' + result['error'] if 'error' in result else 'done'} "
            f"({result['wall_s']:.0f} s)")
    if built is None:
        log(f"{w.name}: nothing left to measure in {path} (--redo measures again)")
    write_json_atomic(path, doc)
    return doc
