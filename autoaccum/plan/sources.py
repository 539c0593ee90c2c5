"""Where a plan comes from: a ``Plan``, a probe report, a search result or a plan file (read and
checked here), or a target and a micro-batch; and how its source is said in output."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoaccum.plan.plan import Plan

__all__ = ["PlanDocument", "read_plan", "read_plan_document", "resolve_plan", "source_words"]

SOURCE_WORDS = {"probe": "measured by the probe", "cache": "from the probe's cache (measured earlier for this model, "
                "device and budget)", "given": "as given", "checkpoint": "from the checkpoint"}


def source_words(source: str | None) -> str:
    """``probe`` -> ``measured by the probe``, and so on (``SOURCE_WORDS``); another source as it is."""
    return SOURCE_WORDS.get(source or "", source or "")


@dataclass(frozen=True)
class PlanDocument:
    """What a plan source holds (``read_plan_document``).

    Attributes:
        plan: the plan.
        knobs: the knobs a search measured it with (``saver``, ``autocast``, ``compile``), None where none.
        kind: the document's ``kind`` (``autoaccum.probe``, ``autoaccum.search``, ``autoaccum.plan``), None
            for a bare plan.
        model_fingerprint: the model it was measured on (``autoaccum.probe.report.model_fingerprint``), ""
            where it names none (a ``Plan`` is the caller's explicit choice of a cut).
        model_summary: that model in words.
    """

    plan: Plan
    knobs: dict[str, Any] | None = None
    kind: str | None = None
    model_fingerprint: str = ""
    model_summary: str = ""


def read_plan_document(source: Any, *, kinds: tuple[str, ...] | None = None) -> PlanDocument:
    """The one reader of plans: what ``source`` holds.

    ``source`` is what the tools write: a Plan; an object with a ``.plan`` (ProbeReport, SearchResult,
    and its ``.knobs``); a dict (a plan, or a document with a ``"plan"`` entry and maybe ``"knobs"``); or
    the path of such a JSON document (``autoaccum probe --json``, ``autoaccum search --out``).

    Args:
        source: one of those.
        kinds: the document kinds accepted (a file read by ``autoaccum.search.read_plan_file`` must name
            one, so that a stray JSON dict is not taken for a plan); None accepts a bare plan too.

    Raises:
        ValueError: the file cannot be read, holds no plan, or is not of ``kinds``.
        TypeError: ``source`` is none of those.
    """
    if isinstance(source, Plan):
        document: Any = {"plan": source}
    elif isinstance(getattr(source, "plan", None), Plan):
        knobs = getattr(source, "knobs", None)
        kind = "autoaccum.search" if knobs is not None else "autoaccum.probe" if hasattr(source, "candidates") else None
        return PlanDocument(source.plan, knobs.to_dict() if hasattr(knobs, "to_dict") else None, kind,
                            str(getattr(source, "model_fingerprint", "")), str(getattr(source, "model_summary", "")))
    elif isinstance(source, (str, os.PathLike)):
        try:
            document = json.loads(Path(source).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"Invalid plan file {str(source)!r}: {exc}") from None
    else:
        document = source
    if not isinstance(document, dict):
        raise TypeError(f"plan must be a Plan, a probe report, a search result, a dict or a JSON path, "
                        f"got {type(source).__name__}")
    if not isinstance(document.get("plan"), (dict, Plan)):
        document = {"plan": document}  # a plan's own dict
    kind = document.get("kind")
    if kinds is not None and kind not in kinds:
        where = f"{str(source)!r}" if isinstance(source, (str, os.PathLike)) else "the document"
        raise ValueError(f"{where} is not an autoaccum plan file: expected JSON with kind one of {', '.join(kinds)} "
                         f"and a 'plan' (write one with `autoaccum search --out` or `autoaccum probe --json`)")
    plan = document["plan"]
    if not isinstance(plan, Plan):
        try:
            plan = Plan.from_dict(plan)
        except TypeError as exc:
            raise ValueError(f"malformed plan: {exc}") from None
        _check_written(plan)
    knobs = document.get("knobs")
    return PlanDocument(plan, dict(knobs) if isinstance(knobs, dict) else None, kind,
                        str(document.get("model_fingerprint") or ""), str(document.get("model_summary") or ""))


def _check_written(plan: Plan) -> None:
    """A plan read from a dict or a file (written by hand, perhaps) whose micro-batch is above a rank's share of the
    step: ``Plan.for_target`` never cuts one, and running it would quietly train at the share instead."""
    share = plan.rank_batch(0)
    if plan.tokens is None and plan.micro_batch > share:
        raise ValueError(f"Invalid plan: micro_batch {plan.micro_batch} is more than a rank's share of target_batch "
                         f"{plan.target_batch} over {plan.world_size} rank(s) ({share}); a micro-batch never holds "
                         f"more than a step. Allowed range: 1 ~ {share}; write micro_batch {share} with accum_steps "
                         f"1, or build it with autoaccum.Plan.for_target({plan.target_batch}, {plan.micro_batch})")


def read_plan(source: Any) -> Plan:
    """The ``Plan`` in ``source`` (see ``read_plan_document``)."""
    return read_plan_document(source).plan


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
        TypeError: neither a plan nor target_batch and micro_batch, or a plan and micro_batch.
        ValueError: the plan is for another target batch (or, without ``adapt_world_size``, another world size).
    """
    if plan is None:
        if target_batch is None or micro_batch is None:
            raise TypeError("give plan=, or target_batch= and micro_batch=")
        return Plan.for_target(target_batch, micro_batch, world_size)
    if micro_batch is not None:  # which one would win is not the user's to guess
        raise TypeError(f"give plan= or micro_batch=, not both (micro_batch={micro_batch!r}); to cut a plan at "
                        f"another micro-batch, pass plan.with_micro_batch({micro_batch!r})")
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
