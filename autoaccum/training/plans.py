"""Where a run's first plan comes from, for ``fit`` and the integrations alike: the checkpoint's guard
state, the plan (or micro-batch) given, or the probe's; one plan for every rank."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from autoaccum.distributed.sync import GradSync
from autoaccum.log import user_stacklevel
from autoaccum.plan.plan import Plan
from autoaccum.plan.sources import read_plan_document, resolve_plan
from autoaccum.probe.report import ProbeReport, check_made_for

__all__ = ["choose_plan"]


def choose_plan(*, saved: dict[str, Any] | None, given: Any, micro_batch: int | None, target_batch: int,
                sync: GradSync, model: torch.nn.Module, precision: str,
                probe: Callable[[], ProbeReport]) -> tuple[Plan, str, ProbeReport | None]:
    """The plan training starts with, where it came from (``checkpoint``, ``given``, ``probe`` or ``cache``)
    and the probe's report (when it probed).

    Args:
        saved: a checkpoint's guard state (``OOMGuard.state_dict``), which wins; None for a fresh run.
        given: a plan, probe report, search result or plan file the user gave (``plan=``), or None.
        micro_batch: a micro-batch the user gave instead (``micro_batch=``, the integrations), or None.
        target_batch: the run's global batch; a plan for another one is refused.
        sync: the run's ranks: a plan made for another number of ranks is re-cut for them, and every rank
            starts with the same plan (the smallest micro-batch any rank proposes).
        model: the module measured (a probe report or search result of another model is refused).
        precision: the run's precision (a search plan measured under another one is named).
        probe: measures real steps and returns the report (called only where nothing else gives a plan).

    Raises:
        ValueError: a checkpoint or plan for another global batch or model, or an FSDP2 model to probe.
    """
    report = None
    if saved is not None:
        plan, source = Plan.from_dict(saved["plan"]).with_world_size(sync.world_size), "checkpoint"
        if plan.target_batch != target_batch:
            raise ValueError(f"the checkpoint's guard state is for target_batch {plan.target_batch}, this run's "
                             f"global batch is {target_batch}; the global batch is never changed silently")
    elif given is not None or micro_batch is not None:
        if given is not None:
            check_made_for(given, model)
            _warn_unapplied_knobs(given, precision)
        plan = resolve_plan(given, target_batch=target_batch, micro_batch=micro_batch, world_size=sync.world_size,
                            adapt_world_size=True)
        source = "given"
    else:
        if getattr(sync, "kind", None) == "fsdp2":
            raise ValueError("cannot probe an FSDP2 (fully_shard) model: the probe's steps would run collectives whose "
                             "number depends on each rank's measurements. Pass plan= (e.g. a probe report of one "
                             "unsharded replica, or autoaccum.Plan.for_target(target_batch, micro_batch))")
        report = probe()
        plan, source = report.plan, report.source
    if sync.world_size > 1:  # one plan for every rank: the smallest micro-batch any rank can run
        plan = sync.agree_plan(plan)
    return plan, source, report


def _warn_unapplied_knobs(plan: Any, precision: str) -> None:
    """A search plan file also names knobs (the memory saver, autocast, compile); a run applies the plan, its
    memory saver (``plan.saver``) and its own ``precision``, not compile: say so rather than train differently
    from what was measured."""
    try:
        knobs = read_plan_document(plan).knobs
    except (OSError, ValueError, TypeError):
        return  # resolve_plan reads it next and says what is wrong
    if not knobs:
        return
    autocast = knobs.get("autocast", "fp32")
    compiled = bool(knobs.get("compile"))
    if compiled or autocast != precision:
        warnings.warn(f"the plan was measured with knobs {knobs}; the run applies the plan's micro-batch, its memory "
                      f"saver and precision={precision!r} only. Pass precision={autocast!r}"
                      + (" and model=torch.compile(model)" if compiled else "")
                      + " to train as measured.", stacklevel=user_stacklevel())
