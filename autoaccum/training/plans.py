"""Where ``fit``'s plan comes from: the checkpoint's, the one given, or the probe's."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from autoaccum import distributed
from autoaccum.log import user_stacklevel
from autoaccum.plan.plan import Plan
from autoaccum.plan.sources import read_plan_document, resolve_plan
from autoaccum.plan.task import Task
from autoaccum.probe.report import ProbeReport, check_made_for
from autoaccum.probe.run import probe
from autoaccum.distributed.sync import GradSync
from autoaccum.training.config import FitConfig

__all__ = ["choose_plan", "warn_unapplied_knobs"]


def choose_plan(cfg: FitConfig, state: dict[str, Any] | None, sync: GradSync, task: Task,
                optimizer: torch.optim.Optimizer, target_batch: int,
                lengths: tuple[list[int], Any, str] | None = None) -> tuple[Plan, str, ProbeReport | None]:
    """The plan training starts with: the checkpoint's, the given one, or the probe's; one for every rank."""
    report = None
    if state is not None:
        plan, source = Plan.from_dict(state["guard"]["plan"]).with_world_size(sync.world_size), "checkpoint"
    elif cfg.memory.plan is not None:
        check_made_for(cfg.memory.plan, task.model)
        plan = resolve_plan(cfg.memory.plan, target_batch=target_batch, world_size=sync.world_size,
                            adapt_world_size=True)
        source = "given"
        warn_unapplied_knobs(cfg.memory.plan, cfg.memory.precision)
    else:
        if isinstance(sync, distributed.DistributedSync) and sync.kind == "fsdp2":
            raise ValueError("fit cannot probe an FSDP2 (fully_shard) model: the probe's steps would run collectives "
                             "whose number depends on each rank's measurements. Pass plan= (e.g. a probe report "
                             "of one unsharded replica, or autoaccum.Plan.for_target(target_batch, micro_batch))")
        report = probe(task, optimizer=optimizer, target_batch=target_batch, world_size=sync.world_size,
                       budget=cfg.memory.budget, headroom=cfg.memory.headroom, precision=cfg.memory.precision,
                       cache=cfg.memory.probe_cache, lengths=None if lengths is None else lengths[0],
                       lengths_source="" if lengths is None else lengths[2], memory_savers=cfg.memory.memory_savers,
                       progress=cfg.output.progress and cfg.output.verbose and sync.rank == 0)
        plan, source = report.plan, report.source
    if sync.world_size > 1:  # one plan for every rank: the smallest micro-batch any rank can run
        plan = sync.agree_plan(plan)
    return plan, source, report


def warn_unapplied_knobs(plan: Any, precision: str) -> None:
    """A search plan file also names knobs (the memory ladder's rung, autocast, compile); fit applies the
    plan, its rung (``plan.saver``) and its own ``precision``, not compile: say so rather than train
    differently from what was measured."""
    try:
        knobs = read_plan_document(plan)[1]
    except (OSError, ValueError, TypeError):
        return  # resolve_plan has read it already; nothing more to say
    if not knobs:
        return
    autocast = knobs.get("autocast", "fp32")
    compiled = bool(knobs.get("compile"))
    if compiled or autocast != precision:
        warnings.warn(f"the plan was measured with knobs {knobs}; fit applies the plan's micro-batch, its memory "
                      f"saver and precision={precision!r} only. Pass precision={autocast!r}"
                      + (" and model=torch.compile(model)" if compiled else "")
                      + " to train as measured.", stacklevel=user_stacklevel())
