"""One model's parts in order, each saved to ``<out>/<model>.json`` as soon as it is done (resumable).

A rerun keeps the parts already measured (a part that raised keeps its error; ``--redo`` measures
everything again) and runs the rest; a part that cannot run yet is recorded as skipped with its reason
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
from .squeeze import release

__all__ = ["PARTS", "run_model"]

logger = logging.getLogger("real_gpu")

KIND, VERSION = "autoaccum.bench.real_gpu.model", 2
PARTS = ("squeeze", "estimate", "sweep")  # in this order: the sweep times plans up to the brute-force limit


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


def _measured(part: str, built: Built, device: torch.device, settings: parts.Settings,
              doc: dict[str, Any]) -> dict[str, Any]:
    """``part``'s result, or the error it raised (a part that crashes is a finding: kept, and the row goes on)."""
    started = time.perf_counter()
    try:
        result = parts.sweep(built, device, doc["parts"]["squeeze"], settings) if part == "sweep" else \
            (parts.squeezed if part == "squeeze" else parts.estimate)(built, device, settings)
    except Exception as exc:
        logger.error("%s %s failed:\n%s", built.workload.name, part, traceback.format_exc())
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
    if "error" in result:  # outside the except block: what the failed part held is unreachable now
        release(device)
    result["wall_s"] = time.perf_counter() - started
    result["device_name"] = doc["device_name"]  # a model resumed on another card says so (report)
    return result


def run_model(w: Workload, device: torch.device, settings: parts.Settings, size: str, out: Path, *,
              redo: bool = False, measure: bool = True, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure what is missing of ``w``'s parts (``measure=False``: nothing, only read what is saved);
    returns the model's document (also saved under ``out``)."""
    path = out / f"{w.name}.json"
    doc = _load(path, _header(w, device, settings, size), redo)
    missing = missing_dependency(w) if measure else None
    if missing is not None:
        doc["parts"] = {p: {"skipped": f"skipped: {missing}"} for p in PARTS}
    if not measure or missing is not None:
        return doc
    built: Built | None = None
    for part in (p for p in PARTS if p not in doc["parts"] or "skipped" in doc["parts"][p]):
        if part == "sweep" and "brute_force" not in doc["parts"]["squeeze"]:
            doc["parts"][part] = {"skipped": "skipped: no brute-force limit (the squeeze part failed)"}
            log(f"{w.name} {part}: {doc['parts'][part]['skipped']}")
            continue
        if built is None:
            started = time.perf_counter()
            built = build(w, device)
            doc["build_s"] = time.perf_counter() - started
        doc.update(describe=w.describe, params=built.params, target_batch=w.target_batch,
                   budget_bytes=w.budget_bytes, smallest=built.smallest,
                   device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        # Trials and failed tries release memory with a full collection: what lives on (the imports, the
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
