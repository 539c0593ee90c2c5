"""Where a plan comes from: a ``Plan``, a probe report, a search result or a plan file (read and
checked here), or a target and a micro-batch; and how its source is said in output."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from autoaccum.plan.plan import Plan

__all__ = ["read_plan", "read_plan_document", "resolve_plan", "source_words"]

SOURCE_WORDS = {"probe": "measured by the probe", "cache": "from the probe's cache (measured earlier for this model, "
                "device and budget)", "given": "as given", "checkpoint": "from the checkpoint"}


def source_words(source: str | None) -> str:
    """``probe`` -> ``measured by the probe``, and so on (``SOURCE_WORDS``); another source as it is."""
    return SOURCE_WORDS.get(source or "", source or "")


def read_plan_document(source: Any) -> tuple[Plan, dict[str, Any] | None]:
    """The plan in ``source``, and the knobs it was measured with (None where it names none; their
    ``saver`` is the plan's rung of the memory ladder, also for files that named it only as
    ``"checkpointing": true`` among their knobs).

    ``source`` is what the tools write: a Plan; an object with a ``.plan`` (ProbeReport,
    SearchResult, and its ``.knobs``); a dict (a plan, or a document with a ``"plan"`` entry and
    maybe ``"knobs"``); or the path of such a JSON document (``autoaccum probe --json``,
    ``autoaccum search --out``). The one reader of plan files.

    Raises:
        ValueError: the file cannot be read or holds no plan.
        TypeError: ``source`` is none of those.
    """
    if isinstance(source, Plan):
        return source, None
    if isinstance(getattr(source, "plan", None), Plan):
        knobs = getattr(source, "knobs", None)
        return source.plan, (knobs.to_dict() if hasattr(knobs, "to_dict") else None)
    if isinstance(source, (str, os.PathLike)):
        try:
            source = json.loads(Path(source).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"Invalid plan file {str(source)!r}: {exc}") from None
    if isinstance(source, dict):
        document = source if isinstance(source.get("plan"), dict) else {"plan": source}
        try:
            plan = Plan.from_dict(document["plan"])
        except TypeError as exc:
            raise ValueError(f"malformed plan: {exc}") from None
        knobs = document.get("knobs")
        return _with_rung(plan, dict(knobs) if isinstance(knobs, dict) else None)
    raise TypeError(f"plan must be a Plan, a probe report, a search result, a dict or a JSON path, "
                    f"got {type(source).__name__}")


def _with_rung(plan: Plan, knobs: dict[str, Any] | None) -> tuple[Plan, dict[str, Any] | None]:
    """The plan on the rung its knobs name, and the knobs naming the plan's rung. Search plan files
    written before the plan carried its rung said ``"checkpointing": true`` among the knobs: that was
    measured with checkpointing, so the plan runs on the ``checkpointing`` rung."""
    if knobs is None:
        return plan, None
    legacy = knobs.pop("checkpointing", None)
    saver = knobs.get("saver", "checkpointing" if legacy is True else "none")
    if plan.saver == "none" and saver != "none":
        plan = plan.with_saver(saver)  # Plan checks the name
    return plan, {**knobs, "saver": plan.saver}


def read_plan(source: Any) -> Plan:
    """The ``Plan`` in ``source`` (see ``read_plan_document``)."""
    return read_plan_document(source)[0]


def resolve_plan(plan: Any = None, *, target_batch: int | None = None, micro_batch: int | None = None,
                 world_size: int = 1, adapt_world_size: bool = False) -> Plan:
    """The plan a run starts with: ``plan`` (anything ``read_plan`` reads), or one built from
    ``target_batch`` and ``micro_batch``; checked against the run's target and ranks.

    Args:
        plan: a plan, or anything ``read_plan`` reads; None builds one from the next two.
        target_batch: the run's global batch; a ``plan`` for another one is refused.
        micro_batch: the micro-batch of a plan built here (with ``target_batch``).
        world_size: the number of ranks running.
        adapt_world_size: re-cut a plan made for another number of ranks (the global batch and
            micro-batch stay); otherwise that is an error.

    Raises:
        TypeError: neither a plan nor target_batch and micro_batch.
        ValueError: the plan is for another target batch (or, without ``adapt_world_size``, another world size).
    """
    if plan is None:
        if target_batch is None or micro_batch is None:
            raise TypeError("give plan=, or target_batch= and micro_batch=")
        return Plan.for_target(target_batch, micro_batch, world_size)
    plan = read_plan(plan)
    if target_batch is not None and target_batch != plan.target_batch:
        raise ValueError(f"the plan is for target_batch {plan.target_batch}, this run's is {target_batch}; the "
                         f"global batch is never changed silently: pass target_batch={plan.target_batch} or re-plan")
    if plan.world_size != world_size:
        if not adapt_world_size:
            raise ValueError(f"plan.world_size {plan.world_size} differs from the {world_size} ranks running; use "
                             f"plan.with_world_size({world_size})")
        plan = plan.with_world_size(world_size)
    return plan
